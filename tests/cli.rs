//! The `qpmux` binary end to end, as a user runs it: the demo that
//! `cargo run --release` shows, a sweep that measures a few cells,
//! writes them to `sweep.json` and draws the plots (SVG, and PNG where
//! `rsvg-convert` is installed; CI installs it), and pingpong in one process
//! and across several (a server outliving a killed client and a frozen one).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qpmux-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn has_rsvg_convert() -> bool {
    Command::new("rsvg-convert")
        .arg("--version")
        .output()
        .is_ok()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The README's main command, shortened: every path's row, each record
/// delivered, none failed, the mux rows batching, no RNR NAK on the RDMA row.
#[test]
fn the_demo_prints_a_row_per_path() {
    let run = Command::new(env!("CARGO_BIN_EXE_qpmux"))
        .args(["demo", "--passes", "20", "--json"])
        .output()
        .expect("qpmux runs");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "qpmux demo failed: {stderr}");
    let rows: serde_json::Value = serde_json::from_slice(&run.stdout).expect("JSON rows");
    let rows = rows.as_array().expect("a list of rows");
    let paths: Vec<&str> = rows.iter().filter_map(|r| r["path"].as_str()).collect();
    let mut expected = vec!["qpmux-rdma", "qpmux-tcp", "mem"];
    if cfg!(feature = "velo") {
        expected.extend(["velo-tcp-mux", "velo-tcp-stream"]);
    }
    assert_eq!(paths, expected, "shown in a fixed order");
    // Run in some order: each place once.
    let mut places: Vec<u64> = rows.iter().filter_map(|r| r["ran"].as_u64()).collect();
    places.sort_unstable();
    assert_eq!(places, (1..=expected.len() as u64).collect::<Vec<_>>());
    for row in rows {
        assert!(row["error"].is_null(), "{row}");
        assert_eq!(row["records"].as_u64(), Some(64 * 20), "{row}");
    }
    for row in &rows[..3] {
        let per_batch = row["records_per_batch"]
            .as_f64()
            .expect("records per batch");
        assert!(per_batch > 1.0, "{row}");
    }
    assert_eq!(rows[0]["rnr_naks"].as_u64(), Some(0), "{}", rows[0]);
}

#[test]
fn a_sweep_writes_its_cells_as_json_and_draws_the_plots() {
    let out = fresh_dir("sweep");
    let run = Command::new(env!("CARGO_BIN_EXE_qpmux"))
        .args(["bench", "sweep", "--rounds", "1", "--no-criteria"])
        .args(["--cells", "qpmux-rdma:grid:8:1,qpmux-tcp:grid:8:1", "--out"])
        .arg(&out)
        .output()
        .expect("qpmux runs");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "qpmux bench sweep failed: {stderr}");

    let doc: serde_json::Value =
        serde_json::from_slice(&read(&out.join("sweep.json"))).expect("sweep.json is JSON");
    let cells = doc["cells"].as_array().expect("a list of cells");
    assert_eq!(cells.len(), 2, "{doc}");
    for path in ["qpmux-rdma", "qpmux-tcp"] {
        let cell = cells
            .iter()
            .find(|c| c["path"] == path)
            .unwrap_or_else(|| panic!("no {path} cell in {doc}"));
        assert_eq!((cell["x"].as_u64(), cell["y"].as_u64()), (Some(8), Some(1)));
        // Eight streams, a pass every 5 ms: records share batches.
        let per_batch = cell["records_per_batch"]
            .as_f64()
            .expect("records per batch");
        assert!(per_batch > 1.0 && per_batch <= 8.0 * 200.0, "{cell}");
        // One 64-byte record per slot per pass is far inside every credit
        // window: no send waits, so no record is stamped from before it.
        assert_eq!(cell["held_sends"].as_u64(), Some(0), "{cell}");
        // One probe per CPU the sweep may use, each a time.
        let probes = cell["cpu_probe_us"].as_array().expect("probes");
        assert!(!probes.is_empty(), "{cell}");
        assert!(
            probes
                .iter()
                .all(|us| us.as_f64().is_some_and(|us| us > 0.0)),
            "{cell}"
        );
        // What earlier cells left running (the sweep runs in `block_on`,
        // not a task), and the process's threads: main and two workers.
        assert!(cell["tasks_before"].as_u64().is_some(), "{cell}");
        assert!(
            cell["threads_before"].as_u64().is_some_and(|n| n >= 3),
            "{cell}"
        );
        for field in ["cpu_us_per_record", "p50_us", "p99_us", "records_per_sec"] {
            assert!(
                cell[field].as_f64().is_some_and(|v| v > 0.0),
                "{field}: {cell}"
            );
        }
    }

    let png = has_rsvg_convert();
    if !png {
        eprintln!("rsvg-convert is not installed: SVG plots only");
    }
    for plot in ["cpu_per_record", "p50_latency", "p99_latency"] {
        let svg = String::from_utf8(read(&out.join(format!("{plot}.svg")))).expect("UTF-8 SVG");
        assert!(svg.contains("<svg"), "{plot}.svg is not an SVG");
        for path in ["qpmux-rdma", "qpmux-tcp"] {
            assert!(svg.contains(path), "{plot}.svg has no {path} line");
        }
        if png {
            let bytes = read(&out.join(format!("{plot}.png")));
            assert!(bytes.starts_with(b"\x89PNG"), "{plot}.png is not a PNG");
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

fn run_qpmux(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qpmux"))
        .args(args)
        .output()
        .expect("qpmux runs")
}

fn qpmux_json(args: &[&str]) -> serde_json::Value {
    let run = run_qpmux(&[args, &["--json"]].concat());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "qpmux {args:?} failed: {stderr}");
    serde_json::from_slice(&run.stdout).unwrap_or_else(|e| {
        panic!(
            "qpmux {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&run.stdout)
        )
    })
}

/// A latency table's rows: one per size, every iteration measured, the
/// quantiles in order.
fn assert_latency_rows(rows: &serde_json::Value, sizes: &[u64], iters: u64) {
    let rows = rows.as_array().expect("a list of rows");
    assert_eq!(rows.len(), sizes.len(), "{rows:?}");
    for (row, &size) in rows.iter().zip(sizes) {
        assert_eq!(row["bytes"].as_u64(), Some(size), "{row}");
        assert_eq!(row["iterations"].as_u64(), Some(iters), "{row}");
        let t = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("{k}: {row}"));
        assert!(t("t_min_us") > 0.0, "{row}");
        assert!(t("t_min_us") <= t("t_typ_us"), "{row}");
        assert!(t("t_typ_us") <= t("t_99_us"), "{row}");
        assert!(t("t_99_us") <= t("t_max_us"), "{row}");
        assert!(
            t("t_min_us") <= t("t_avg_us") && t("t_avg_us") <= t("t_max_us"),
            "{row}"
        );
    }
}

#[test]
fn pingpong_measures_latency_and_bandwidth_in_one_process() {
    let lat = qpmux_json(&["pingpong", "--iters", "200", "--size", "64,4096"]);
    assert_latency_rows(&lat, &[64, 4096], 200);
    let cold = qpmux_json(&["pingpong", "--iters", "50", "--warmup", "0", "--size", "64"]);
    assert_latency_rows(&cold, &[64], 50);

    for transport in ["rdma", "tcp"] {
        let bw = qpmux_json(&[
            "pingpong",
            "--transport",
            transport,
            "--test",
            "bw",
            "--iters",
            "3000",
            "--size",
            "64",
        ]);
        let rows = bw.as_array().expect("a list of rows");
        assert_eq!(rows.len(), 1, "{bw}");
        let row = &rows[0];
        assert_eq!(row["bytes"].as_u64(), Some(64), "{row}");
        assert_eq!(row["iterations"].as_u64(), Some(3000), "{row}");
        let bw_mib = row["bw_mib_s"].as_f64().expect("bandwidth");
        let rate = row["msg_rate_mpps"].as_f64().expect("message rate");
        assert!(bw_mib > 0.0 && rate > 0.0, "{row}");
        // One consistent pair: 64 B a message.
        let implied = rate * 1e6 * 64.0 / f64::from(1 << 20);
        assert!((implied - bw_mib).abs() <= 1e-6 * bw_mib.max(1.0), "{row}");
    }
}

/// Kills a child process however the test ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_qpmux(args: &[&str], stdout: Stdio, stderr: Stdio) -> Child {
    Child(
        Command::new(env!("CARGO_BIN_EXE_qpmux"))
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .expect("qpmux starts"),
    )
}

/// A fresh directory for a server's stderr, and the file in it.
fn server_log_path(name: &str) -> (PathBuf, PathBuf) {
    let dir = fresh_dir(name);
    std::fs::create_dir_all(&dir).expect("log dir");
    let log = dir.join("stderr");
    (dir, log)
}

/// The server's log, which must say exactly one client was abandoned.
fn abandoned_once(log: &Path) -> String {
    let log = String::from_utf8_lossy(&read(log)).into_owned();
    assert_eq!(log.matches("pingpong client abandoned").count(), 1, "{log}");
    log
}

/// Starts `qpmux pingpong --server` on an ephemeral port (with `extra`
/// flags, its stderr into `log`); returns it and the address blob it printed.
fn pingpong_server(extra: &[&str], log: &Path) -> (Child, String) {
    let mut server = spawn_qpmux(
        &[&["pingpong", "--server", "127.0.0.1:0"], extra].concat(),
        Stdio::piped(),
        std::fs::File::create(log).expect("log file").into(),
    );
    let mut first = String::new();
    BufReader::new(server.0.stdout.take().expect("piped"))
        .read_line(&mut first)
        .expect("the server prints its address");
    let blob = first
        .trim()
        .strip_prefix("pingpong server; address: ")
        .unwrap_or_else(|| panic!("unexpected first line: {first:?}"))
        .to_string();
    (server, blob)
}

/// Starts a bandwidth run long enough to hold the server at `blob` and
/// returns it once a latency run (`lat_run`) was refused, with its reason,
/// while it ran. A latency run that gets in first is served and the long
/// one refused: then the long one starts again.
fn hold_the_server(blob: &str, extra: &[&str], lat_run: &[&str]) -> Child {
    let long_run_args = [
        &[
            "pingpong",
            "--client",
            blob,
            "--test",
            "bw",
            "--iters",
            "1000000000",
            "--size",
            "64",
        ],
        extra,
    ]
    .concat();
    let mut long_run = spawn_qpmux(&long_run_args, Stdio::null(), Stdio::null());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let stderr = loop {
        if long_run.0.try_wait().expect("waitable").is_some() {
            long_run = spawn_qpmux(&long_run_args, Stdio::null(), Stdio::null());
        }
        let run = run_qpmux(lat_run);
        if !run.status.success() {
            break String::from_utf8_lossy(&run.stderr).into_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no client was refused while the long run was on"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(stderr.contains("one client at a time"), "{stderr}");
    assert!(
        long_run.0.try_wait().expect("waitable").is_none(),
        "the long run ended"
    );
    long_run
}

/// Runs `lat_run` until the server serves it (it refuses while it still
/// holds an earlier client), within `patience`; returns its JSON rows.
fn served_after(lat_run: &[&str], patience: std::time::Duration, why: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + patience;
    loop {
        let run = run_qpmux(&[lat_run, &["--json"]].concat());
        let stderr = String::from_utf8_lossy(&run.stderr);
        if run.status.success() {
            break serde_json::from_slice(&run.stdout).expect("JSON rows");
        }
        assert!(stderr.contains("one client at a time"), "{stderr}");
        assert!(std::time::Instant::now() < deadline, "{why}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A server in its own process on an ephemeral port, clients reaching it by
/// the address blob it prints: two runs one after the other, a second client
/// refused (with a reason) while a run is on, and, once that run's client
/// is killed mid-session, the next run served.
#[test]
fn pingpong_serves_runs_between_processes_one_at_a_time() {
    let (log_dir, log) = server_log_path("pingpong-server");
    let (server, blob) = pingpong_server(&[], &log);
    let lat_run = [
        "pingpong", "--client", &blob, "--iters", "200", "--size", "64",
    ];
    assert_latency_rows(&qpmux_json(&lat_run), &[64], 200);
    // The server lets the finished client go when it sees its link end (a
    // poll every 10 ms); a loaded machine can start the next client sooner.
    let second = served_after(
        &lat_run,
        std::time::Duration::from_secs(30),
        "the finished run's client was never let go",
    );
    assert_latency_rows(&second, &[64], 200);
    let long_run = hold_the_server(&blob, &[], &lat_run);
    // Killed mid-session: the server hears its link go and serves the next
    // run (which it may refuse until then).
    drop(long_run);
    let served = served_after(
        &lat_run,
        std::time::Duration::from_secs(30),
        "the killed run's client was never forgotten",
    );
    assert_latency_rows(&served, &[64], 200);
    drop(server);
    // Finished runs end cleanly at the server too: only the killed one was
    // abandoned.
    abandoned_once(&log);
    let _ = std::fs::remove_dir_all(&log_dir);
}

/// A run that holds the server past its `--max-run` is given up on, and
/// the client says why instead of its session's own error.
#[test]
fn pingpong_client_past_the_servers_max_run_is_told_why() {
    let (log_dir, log) = server_log_path("pingpong-max-run");
    let (server, blob) = pingpong_server(&["--transport", "tcp", "--max-run", "2"], &log);
    let client_log = log_dir.join("client");
    let mut client = spawn_qpmux(
        &[
            "pingpong",
            "--client",
            &blob,
            "--transport",
            "tcp",
            "--test",
            "bw",
            "--size",
            "64",
            "--iters",
            "4000000000",
        ],
        Stdio::null(),
        std::fs::File::create(&client_log).expect("log file").into(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = client.0.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the client still ran 60 s into a 2 s --max-run"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let said = std::fs::read_to_string(&client_log).expect("client log");
    assert!(!status.success(), "{said}");
    assert!(
        said.contains("the server gave up on the run") && said.contains("--max-run"),
        "{said}"
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&log_dir);
}

/// A client frozen mid-run (SIGSTOP) over the TCP transport keeps its
/// connection up and says nothing: the server gives up on it after its
/// silence bound and serves the next run.
#[test]
fn pingpong_server_abandons_a_frozen_client() {
    let (log_dir, log) = server_log_path("pingpong-frozen");
    let tcp = ["--transport", "tcp"];
    let (server, blob) = pingpong_server(&tcp, &log);
    let lat_run = [
        "pingpong",
        "--client",
        &blob,
        "--iters",
        "200",
        "--size",
        "64",
        "--transport",
        "tcp",
    ];
    let frozen = hold_the_server(&blob, &tcp, &lat_run);
    let pid = i32::try_from(frozen.0.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .expect("a child's pid");
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("SIGSTOP");
    let served = served_after(
        &lat_run,
        std::time::Duration::from_secs(45),
        "a frozen client held the server",
    );
    assert_latency_rows(&served, &[64], 200);
    drop(frozen);
    drop(server);
    let log = abandoned_once(&log);
    assert!(log.contains("silent"), "{log}");
    let _ = std::fs::remove_dir_all(&log_dir);
}

/// `qpmux pingpong --client blob` for a short latency run, then `extra`.
fn short_client_run<'a>(blob: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let plain = [
        "pingpong", "--client", blob, "--iters", "20", "--size", "64",
    ];
    [&plain[..], extra].concat()
}

/// Runs a client the server must refuse as the other transport.
fn refused_as_the_other_transport(args: &[&str]) {
    let run = run_qpmux(args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("runs the other transport"), "{stderr}");
}

/// A client that dials with the other transport is told so by the server
/// and fails by name, both ways round, and the server keeps serving.
#[test]
fn pingpong_client_of_the_other_transport_is_told_so() {
    let (log_dir, log) = server_log_path("pingpong-mismatch");
    let tcp = ["--transport", "tcp"];
    let (server, blob) = pingpong_server(&tcp, &log);
    refused_as_the_other_transport(&short_client_run(&blob, &[]));
    let served = served_after(
        &short_client_run(&blob, &tcp),
        std::time::Duration::from_secs(30),
        "a mismatched client held the server",
    );
    assert_latency_rows(&served, &[64], 20);
    drop(server);
    let (server, blob) = pingpong_server(&[], &log);
    refused_as_the_other_transport(&short_client_run(&blob, &tcp));
    drop(server);
    let _ = std::fs::remove_dir_all(&log_dir);
}
