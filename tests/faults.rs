//! Multi-host faults: `qpmux soak` nodes in network namespaces A and B,
//! routed through R, where the faults are made (docs/faults.md).
//!
//! ```text
//!  A (soak send) ── veth ── R: forward | tproxy ─► qpmux relay | nft drop ── veth ── B (soak recv)
//! ```
//!
//! Each scenario reads the nodes' JSON-line events and asserts its verdict
//! from them. Needs root, `ip` and `nft`; otherwise it prints why and skips
//! (QPMUX_FAULTS_REQUIRE=1 turns a skip into a failure, for CI).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const A_IP: &str = "10.77.1.2";
const B_IP: &str = "10.77.2.2";
const A_UDP: u16 = 7101;
const B_UDP: u16 = 7102;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/faults/netns.sh")
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Why this machine cannot run the scenarios, if it cannot.
fn unavailable() -> Option<String> {
    let uid = Command::new("id").arg("-u").output();
    match uid {
        Ok(out) if String::from_utf8_lossy(&out.stdout).trim() == "0" => {}
        _ => return Some("not root".into()),
    }
    for tool in ["ip", "nft"] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("no `{tool}` command"));
        }
    }
    None
}

/// A process's JSON-line events, with the time each was read.
type Events = Arc<Mutex<Vec<Value>>>;

/// One qpmux process in a namespace.
struct Proc {
    child: Child,
    events: Events,
}

impl Proc {
    fn events(&self) -> Vec<Value> {
        self.events.lock().expect("events").clone()
    }

    fn of_kind(&self, kind: &str) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e["event"] == kind)
            .collect()
    }

    /// Waits until `pred` holds for one of the events; returns it.
    fn wait_for(&self, what: &str, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let until = Instant::now() + within;
        loop {
            if let Some(e) = self.events().into_iter().find(|e| pred(e)) {
                return e;
            }
            assert!(Instant::now() < until, "no {what} within {within:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn progress(&self) -> u64 {
        self.of_kind("progress")
            .last()
            .and_then(|e| e["records"].as_u64())
            .unwrap_or(0)
    }

    /// Waits for the process to exit and returns its verdict; fails at once
    /// on a `stall` event.
    fn verdict(&mut self, within: Duration) -> Value {
        let until = Instant::now() + within;
        while self.child.try_wait().expect("try_wait").is_none() {
            assert!(
                Instant::now() < until,
                "node still running after {within:?}"
            );
            if let Some(stall) = self.of_kind("stall").first() {
                panic!("stalled: {stall}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // The reader thread may still hold the last line.
        self.wait_for("verdict", Duration::from_secs(2), |e| {
            e["event"] == "verdict"
        })
    }
}

/// Namespaces A, R, B and the processes in them; all torn down on drop.
struct Net {
    tag: String,
    dir: PathBuf,
    procs: Vec<Spawned>,
}

/// What a failed scenario prints about each process it started.
struct Spawned {
    name: String,
    pid: u32,
    events: Events,
}

/// Events, stderr lines and stack frames per thread of each process shown
/// when a scenario fails; frame lines are cut at `FRAME_CHARS`.
const EVENTS_SHOWN: usize = 12;
const STDERR_LINES_SHOWN: usize = 60;
const FRAMES_SHOWN: usize = 14;
const FRAME_CHARS: usize = 220;

/// gdb's `thread apply all bt`, cut to each thread's top frames.
fn top_frames(bt: &str) -> Vec<String> {
    let mut kept = Vec::new();
    let mut frames = 0;
    for line in bt.lines() {
        if line.starts_with("Thread ") {
            frames = 0;
            kept.push(line.to_string());
        } else if line.starts_with('#') {
            frames += 1;
            if frames <= FRAMES_SHOWN {
                kept.push(line.chars().take(FRAME_CHARS).collect());
            }
        }
    }
    kept
}

/// Unless the caller chose a filter, the nodes log dials, accepts, declines,
/// link and epoch ends and socket errors: a failure in CI shows how epochs
/// went.
const NODE_LOG: &str = "qpmux::link=debug,qpmux::mux=debug,qpmux::verbs=debug,warn";

impl Net {
    /// Sets the namespaces up, or says why not (printed by the caller).
    fn up(scenario: &str) -> Result<Net, String> {
        if let Some(reason) = unavailable() {
            return Err(reason);
        }
        // Short: interface names are at most 15 bytes.
        let tag = format!("{}{}", std::process::id() % 100_000, &scenario[..1]);
        let dir = std::env::temp_dir().join(format!("qpmux-faults-{tag}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let net = Net {
            tag,
            dir,
            procs: Vec::new(),
        };
        net.script(&["up"])?;
        Ok(net)
    }

    fn script(&self, args: &[&str]) -> Result<(), String> {
        let mut full = vec![args[0], self.tag.as_str()];
        full.extend_from_slice(&args[1..]);
        let out = Command::new("sh")
            .arg(script())
            .args(&full)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "netns.sh {full:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    fn ns(&self, host: char) -> String {
        format!("qf-{host}-{}", self.tag)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Starts `qpmux ARGS` in namespace `host`; stdout parsed as events.
    fn spawn(&mut self, host: char, name: &str, args: &[String]) -> Proc {
        let stderr = std::fs::File::create(self.file(&format!("{name}.err"))).expect("stderr");
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| NODE_LOG.into());
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns(host),
                env!("CARGO_BIN_EXE_qpmux"),
                "--json",
            ])
            .args(args)
            .env("RUST_LOG", log)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn ip netns exec");
        let events: Events = Arc::default();
        self.procs.push(Spawned {
            name: name.into(),
            pid: child.id(),
            events: events.clone(),
        });
        let out = child.stdout.take().expect("piped");
        let sink = events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Ok(event) = serde_json::from_str::<Value>(&line) {
                    sink.lock().expect("events").push(event);
                }
            }
        });
        Proc { child, events }
    }

    /// Arguments of a soak node on host `a` (sender) or `b` (receiver).
    fn soak(&self, host: char, extra: &[String]) -> Vec<String> {
        let (role, id, ip, udp, own, peer) = match host {
            'a' => ("send", "1", A_IP, A_UDP, "a.addr", "b.addr"),
            _ => ("recv", "2", B_IP, B_UDP, "b.addr", "a.addr"),
        };
        let mut args: Vec<String> = [
            "soak",
            "--role",
            role,
            "--id",
            id,
            "--bind",
            &format!("{ip}:7000"),
            "--udp-port",
            &udp.to_string(),
            "--addr-file",
            &self.file(own).display().to_string(),
            "--peer-file",
            &self.file(peer).display().to_string(),
            "--done-file",
            &self.file("done").display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend_from_slice(extra);
        args
    }
}

impl Net {
    /// Prints each process's last events and stderr lines (for a failure).
    fn dump(&self) {
        for p in &self.procs {
            let events = p.events.lock().map(|e| e.clone()).unwrap_or_default();
            // Progress lines would hide the rest: only the last one is shown.
            let last_progress = events.iter().rposition(|e| e["event"] == "progress");
            let shown: Vec<&Value> = events
                .iter()
                .enumerate()
                .filter(|(i, e)| e["event"] != "progress" || Some(*i) == last_progress)
                .map(|(_, e)| e)
                .collect();
            eprintln!(
                "--- {}: last events of {} (one progress) ---",
                p.name,
                events.len()
            );
            for e in &shown[shown.len().saturating_sub(EVENTS_SHOWN)..] {
                eprintln!("{e}");
            }
            let stderr =
                std::fs::read_to_string(self.file(&format!("{}.err", p.name))).unwrap_or_default();
            let lines: Vec<&str> = stderr.lines().collect();
            eprintln!("--- {}: last stderr lines of {} ---", p.name, lines.len());
            for line in &lines[lines.len().saturating_sub(STDERR_LINES_SHOWN)..] {
                eprintln!("{line}");
            }
            // A node that stopped answering shows where its threads wait.
            let stacks = Command::new("timeout")
                .args(["20", "gdb", "-batch", "-p", &p.pid.to_string()])
                .args(["-ex", "thread apply all bt 30"])
                .stdin(Stdio::null())
                .output();
            match stacks {
                Ok(out) if out.status.success() => {
                    let text = String::from_utf8_lossy(&out.stdout);
                    eprintln!("--- {}: thread stacks (top frames) ---", p.name);
                    for line in top_frames(&text) {
                        eprintln!("{line}");
                    }
                }
                Ok(out) => eprintln!("--- {}: no stacks (gdb: {}) ---", p.name, out.status),
                Err(err) => eprintln!("--- {}: no stacks ({err}) ---", p.name),
            }
        }
        if let Ok(relay) = std::fs::read_to_string(self.file("relay.json")) {
            eprintln!("--- relay counts: {relay} ---");
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump();
        }
        for p in &self.procs {
            let _ = Command::new("kill")
                .args(["-KILL", &p.pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        if let Err(err) = self.script(&["down"]) {
            eprintln!("teardown: {err}");
        }
        if std::env::var_os("QPMUX_FAULTS_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The namespaces, or `None` after printing why the scenario is skipped.
fn net_or_skip(scenario: &str) -> Option<Net> {
    match Net::up(scenario) {
        Ok(net) => Some(net),
        Err(reason) => {
            assert!(
                std::env::var_os("QPMUX_FAULTS_REQUIRE").is_none(),
                "QPMUX_FAULTS_REQUIRE is set but {scenario} cannot run: {reason}"
            );
            eprintln!("skipping {scenario}: {reason}");
            None
        }
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn count(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

/// Asserts a clean verdict: no violation, every slot finished.
fn assert_clean(who: &str, verdict: &Value) {
    for field in [
        "duplicates",
        "gaps",
        "holes",
        "missing",
        "bad_records",
        "violation_count",
    ] {
        assert_eq!(count(verdict, field), 0, "{who}: {field} in {verdict}");
    }
    assert_eq!(verdict["ok"], true, "{who}: {verdict}");
    assert_eq!(
        count(verdict, "slots_finished"),
        count(verdict, "slots"),
        "{who}: {verdict}"
    );
}

/// Exactly one `Dropped` per slot, all for `epoch`.
fn assert_one_drop_per_slot(who: &str, node: &Proc, slots: u64, epoch: u64) {
    let drops = node.of_kind("dropped");
    let mut per_slot = vec![0u64; slots as usize];
    for d in &drops {
        assert_eq!(count(d, "epoch"), epoch, "{who}: {d}");
        per_slot[count(d, "slot") as usize] += 1;
    }
    assert!(
        per_slot.iter().all(|&n| n == 1),
        "{who}: Dropped per slot {per_slot:?}"
    );
}

/// 1% loss, 1% duplication, 1% held back 3 ms and 0–5 ms jitter through
/// the relay, 64 slots: every record arrives once, in order, intact, and
/// the provider's retransmissions show the faults were there.
#[test]
fn an_impaired_path_loses_duplicates_and_reorders_no_record() {
    let Some(mut net) = net_or_skip("impaired") else {
        return;
    };
    let slots = env_u64("QPMUX_FAULTS_SLOTS", 64);
    let records = env_u64("QPMUX_FAULTS_RECORDS", 100);
    let seed = env_u64("QPMUX_FAULTS_SEED", 0x5eed);
    let bound = env_u64("QPMUX_FAULTS_SECONDS", 50);
    let stall_s = env_u64("QPMUX_FAULTS_STALL_S", 10);
    let relay = spawn_relay(&mut net, seed);
    let shape = strings(&[
        "--slots",
        &slots.to_string(),
        "--records",
        &records.to_string(),
        "--duration-s",
        &bound.to_string(),
        "--stall-s",
        &stall_s.to_string(),
    ]);
    let started = Instant::now();
    let mut b = net.spawn('b', "b", &net.soak('b', &shape));
    let mut a = net.spawn('a', "a", &net.soak('a', &shape));
    let within = Duration::from_secs(bound + 15);
    let b_verdict = b.verdict(within);
    let a_verdict = a.verdict(within);
    let wall = started.elapsed();
    let relay_stats = stop_relay(&relay);
    eprintln!(
        "impaired: {slots} slots x {records} records in {wall:?}; relay {relay_stats}; \
         sender counters {}; receiver counters {}; receiver epochs {} deaths {} dropped {} \
         redelivered {}; sender resent {} abandoned {}",
        a_verdict["counters"],
        b_verdict["counters"],
        b_verdict["epochs_seen"],
        b_verdict["epoch_deaths"],
        b_verdict["dropped"],
        b_verdict["redelivered"],
        a_verdict["resent"],
        a_verdict["abandoned"],
    );
    assert_clean("receiver", &b_verdict);
    assert_clean("sender", &a_verdict);
    assert_eq!(
        count(&b_verdict, "records_unique"),
        slots * records,
        "{b_verdict}"
    );
    if count(&b_verdict, "epoch_deaths") == 0 {
        // Without an epoch death nothing may be sent twice.
        assert_eq!(count(&b_verdict, "records"), slots * records, "{b_verdict}");
        assert_eq!(count(&b_verdict, "dropped"), 0, "{b_verdict}");
        assert_eq!(count(&b_verdict, "streams"), slots, "one stream per slot");
        assert_eq!(b_verdict["epochs_seen"], serde_json::json!([1]));
    }
    for fault in ["dropped", "duplicated", "held", "reordered"] {
        assert!(
            count(&relay_stats, fault) > 0,
            "relay {fault}: {relay_stats}"
        );
    }
    assert_eq!(count(&relay_stats, "seed"), seed);
    let sender = &a_verdict["counters"];
    let receiver = &b_verdict["counters"];
    assert!(
        count(sender, "retransmit_rewinds") > 0,
        "losses made the sender retransmit: {sender}"
    );
    assert!(
        count(receiver, "duplicates_received") + count(receiver, "seq_naks_sent") > 0,
        "the receiver saw duplicates or gaps: {receiver}"
    );
}

/// The relay between A and B (tproxy rules included): 1% loss, 1%
/// duplication, 1% held back 3 ms, 0–5 ms jitter.
fn spawn_relay(net: &mut Net, seed: u64) -> Proc {
    let seed = seed.to_string();
    spawn_relay_with(
        net,
        &[
            "--loss",
            "0.01",
            "--dup",
            "0.01",
            "--reorder",
            "0.01",
            "--jitter-us",
            "5000",
            "--seed",
            &seed,
        ],
    )
}

/// The relay between A and B (tproxy rules included) with `impairment`.
fn spawn_relay_with(net: &mut Net, impairment: &[&str]) -> Proc {
    net.script(&["tproxy", &A_UDP.to_string(), &B_UDP.to_string()])
        .expect("tproxy rules");
    let stats = net.file("relay.json");
    let mut relay_args = strings(&[
        "relay",
        "--peer",
        &format!("{A_IP}:{A_UDP}"),
        "--peer",
        &format!("{B_IP}:{B_UDP}"),
        "--stats-file",
        &stats.display().to_string(),
    ]);
    relay_args.extend(strings(impairment));
    let relay = net.spawn('r', "relay", &relay_args);
    relay.wait_for("relay start", Duration::from_secs(10), |e| {
        e["event"] == "relay_start"
    });
    relay
}

/// Stops the relay; its final counts.
fn stop_relay(relay: &Proc) -> Value {
    let _ = Command::new("kill")
        .args(["-TERM", &relay.child.id().to_string()])
        .status();
    relay.wait_for("relay stats", Duration::from_secs(5), |e| {
        e["event"] == "relay_stats"
    })
}

/// Soak arguments for the link-death scenarios: a paced open-ended stream
/// and an RC retry budget of about 4 × 67 ms.
fn paced(slots: u64, seconds: u64) -> Vec<String> {
    strings(&[
        "--slots",
        &slots.to_string(),
        "--records",
        "0",
        "--pace-us",
        "5000",
        "--duration-s",
        &seconds.to_string(),
        "--rc-timeout",
        "14",
        "--rc-retry",
        "3",
        "--liveness-timeout-ms",
        "3000",
        "--backoff-max-ms",
        "200",
    ])
}

/// `paced`, with the largest RC retry budget (8 × 67 ms): for the scenarios
/// whose fault is not a stop short of the budget, so a node descheduled
/// for a few hundred ms on a loaded machine does not end an extra epoch.
fn paced_patient(slots: u64, seconds: u64) -> Vec<String> {
    let mut args = paced(slots, seconds);
    set_arg(&mut args, "--rc-retry", "7");
    args
}

/// Sets the value of `flag`, which `args` already holds.
fn set_arg(args: &mut [String], flag: &str, value: &str) {
    let at = args.iter().position(|a| a == flag).expect("flag present");
    args[at + 1] = value.to_string();
}

/// A partition longer than the RC retry budget, then heal: one Dropped per
/// live slot on each side, a new epoch, and new streams that finish.
#[test]
fn a_partition_past_the_retry_budget_drops_each_slot_once_and_relinks() {
    let Some(mut net) = net_or_skip("partition") else {
        return;
    };
    let slots = 16;
    let args = paced_patient(slots, 10);
    let mut b = net.spawn('b', "b", &net.soak('b', &args));
    let mut a = net.spawn('a', "a", &net.soak('a', &args));
    let up = Duration::from_secs(15);
    a.wait_for("first epoch", up, |e| e["event"] == "epoch_up");
    b.wait_for("records", up, |e| {
        e["event"] == "progress" && e["records"].as_u64() > Some(slots * 10)
    });
    net.script(&["partition", "on"]).expect("partition");
    // Past the RC retry budget (about 540 ms), short of TCP_USER_TIMEOUT.
    std::thread::sleep(Duration::from_millis(1500));
    net.script(&["partition", "off"]).expect("heal");
    let healed = unix_ms();
    let relinked = a.wait_for("second epoch", up, |e| {
        e["event"] == "epoch_up" && e["epoch"] == 2
    });
    let reconnect_ms = count(&relinked, "t_ms").saturating_sub(healed);
    eprintln!("partition: relinked {reconnect_ms} ms after the heal");
    let before = b.progress();
    b.wait_for("records of the new epoch", up, |e| {
        e["event"] == "progress" && e["records"].as_u64() > Some(before + slots * 10)
    });
    let b_verdict = b.verdict(Duration::from_secs(30));
    let a_verdict = a.verdict(Duration::from_secs(30));
    assert_clean("receiver", &b_verdict);
    assert_clean("sender", &a_verdict);
    assert_one_drop_per_slot("receiver", &b, slots, 1);
    assert_one_drop_per_slot("sender", &a, slots, 1);
    assert_eq!(b_verdict["epochs_seen"], serde_json::json!([1, 2]));
    assert_eq!(a_verdict["epochs_seen"], serde_json::json!([1, 2]));
    assert!(
        count(&a_verdict["counters"], "ack_timeouts") > 0,
        "{a_verdict}"
    );
    assert!(
        reconnect_ms < 10_000,
        "relinked {reconnect_ms} ms after the heal"
    );
}

/// kill -9 of the sender mid-stream, restart on the same address: the
/// receiver drops each slot once, sees the new incarnation, and the
/// restarted sender's streams finish.
#[test]
fn a_killed_peer_restarted_on_its_address_is_a_new_incarnation_and_streams_resume() {
    let Some(mut net) = net_or_skip("kill") else {
        return;
    };
    let slots = 16;
    let mut b = net.spawn('b', "b", &net.soak('b', &paced_patient(slots, 20)));
    let mut a = net.spawn('a', "a", &net.soak('a', &paced_patient(slots, 30)));
    let up = Duration::from_secs(15);
    let first = a.wait_for("start", up, |e| e["event"] == "start");
    b.wait_for("records", up, |e| {
        e["event"] == "progress" && e["records"].as_u64() > Some(slots * 10)
    });
    a.child.kill().expect("kill -9");
    let _ = a.child.wait();
    let killed = unix_ms();
    b.wait_for("epoch down", up, |e| e["event"] == "epoch_down");
    let mut a2 = net.spawn('a', "a2", &net.soak('a', &paced_patient(slots, 3)));
    let second = a2.wait_for("restart", up, |e| e["event"] == "start");
    assert_ne!(first["incarnation"], second["incarnation"]);
    b.wait_for("new incarnation", up, |e| e["event"] == "peer_restarted");
    let relinked = b.wait_for("second epoch", up, |e| {
        e["event"] == "epoch_up" && e["epoch"] == 2
    });
    eprintln!(
        "kill: relinked {} ms after kill -9",
        count(&relinked, "t_ms").saturating_sub(killed)
    );
    let a2_verdict = a2.verdict(Duration::from_secs(30));
    let b_verdict = b.verdict(Duration::from_secs(30));
    assert_clean("receiver", &b_verdict);
    assert_clean("restarted sender", &a2_verdict);
    assert_one_drop_per_slot("receiver", &b, slots, 1);
    assert_eq!(count(&b_verdict, "restarts_seen"), 1, "{b_verdict}");
    assert_eq!(b_verdict["epochs_seen"], serde_json::json!([1, 2]));
    assert_eq!(count(&a2_verdict, "dropped"), 0, "{a2_verdict}");
}

/// The impaired path of the first scenario, cut for 1 s mid-stream: the
/// epoch dies, and each slot resumes from what the receiver acknowledged.
/// Every (slot, index) is verified; the receiver reports redeliveries.
#[test]
fn an_impaired_stream_cut_by_a_partition_resumes_from_the_acknowledged_prefix() {
    let Some(mut net) = net_or_skip("resume") else {
        return;
    };
    let (slots, records) = (16, 400);
    let (relay, mut b, mut a) = paced_pair_under_way(&mut net, 0x5eed, slots, records);
    net.script(&["partition", "on"]).expect("partition");
    // Other lengths shake the race between the dials in flight during the
    // partition and those after it (docs/faults.md).
    let partition_ms = env_u64("QPMUX_FAULTS_PARTITION_MS", 1000);
    std::thread::sleep(Duration::from_millis(partition_ms));
    net.script(&["partition", "off"]).expect("heal");
    let (_, a_verdict) = assert_resumed("resume", &mut b, &mut a, &relay, slots, records);
    assert!(count(&a_verdict, "streams") > slots, "{a_verdict}");
}

/// The relay (seeded `seed`) and a receiver and sender of `slots` paced
/// slots × `records`, once the receiver has 40 records per slot.
fn paced_pair_under_way(net: &mut Net, seed: u64, slots: u64, records: u64) -> (Proc, Proc, Proc) {
    let relay = spawn_relay(net, seed);
    let mut args = paced(slots, 40);
    set_arg(&mut args, "--records", &records.to_string());
    let b = net.spawn('b', "b", &net.soak('b', &args));
    let a = net.spawn('a', "a", &net.soak('a', &args));
    b.wait_for("records", Duration::from_secs(15), |e| {
        e["event"] == "progress" && e["records"].as_u64() > Some(slots * 40)
    });
    (relay, b, a)
}

/// The verdicts of a run on the impaired path whose epochs died (the relay
/// is stopped and its counts printed): both clean, and the receiver saw an
/// epoch die and a slot dropped.
fn verdicts_after_deaths(
    scenario: &str,
    b: &mut Proc,
    a: &mut Proc,
    relay: &Proc,
) -> (Value, Value) {
    let b_verdict = b.verdict(Duration::from_secs(60));
    let a_verdict = a.verdict(Duration::from_secs(30));
    let relay_stats = stop_relay(relay);
    eprintln!(
        "{scenario}: receiver epochs {} deaths {} dropped {} streams {} records {} unique {} \
         redelivered {}; sender streams {} resent {} abandoned {}; relay {relay_stats}",
        b_verdict["epochs_seen"],
        b_verdict["epoch_deaths"],
        b_verdict["dropped"],
        b_verdict["streams"],
        b_verdict["records"],
        b_verdict["records_unique"],
        b_verdict["redelivered"],
        a_verdict["streams"],
        a_verdict["resent"],
        a_verdict["abandoned"],
    );
    assert_clean("receiver", &b_verdict);
    assert_clean("sender", &a_verdict);
    assert!(count(&b_verdict, "epoch_deaths") > 0, "{b_verdict}");
    assert!(count(&b_verdict, "dropped") > 0, "{b_verdict}");
    (b_verdict, a_verdict)
}

/// [`verdicts_after_deaths`], and: every (slot, index) verified, records =
/// unique + redelivered, and nothing redelivered that the sender did not
/// resend (resumed streams started inside the verified prefix).
fn assert_resumed(
    scenario: &str,
    b: &mut Proc,
    a: &mut Proc,
    relay: &Proc,
    slots: u64,
    records: u64,
) -> (Value, Value) {
    let (b_verdict, a_verdict) = verdicts_after_deaths(scenario, b, a, relay);
    assert_eq!(
        count(&b_verdict, "records_unique"),
        slots * records,
        "{b_verdict}"
    );
    assert_eq!(
        count(&b_verdict, "records"),
        slots * records + count(&b_verdict, "redelivered"),
        "{b_verdict}"
    );
    assert!(
        count(&b_verdict, "redelivered") <= count(&a_verdict, "resent"),
        "receiver {b_verdict} sender {a_verdict}"
    );
    (b_verdict, a_verdict)
}

/// Stops `node` (SIGSTOP) for `pause`, then lets it go on (SIGCONT).
fn freeze(node: &Proc, pause: Duration) {
    let pid = node.child.id().to_string();
    let signal = |sig: &str| {
        let status = Command::new("kill").args([sig, &pid]).status();
        assert!(status.is_ok_and(|s| s.success()), "kill {sig} {pid}");
    };
    signal("-STOP");
    std::thread::sleep(pause);
    signal("-CONT");
}

/// On the impaired path, the receiver and then the sender stop for 600 ms
/// mid-stream (past the RC retry budget of about 270 ms), as a GC pause or a
/// stalled VM would stop them: the epoch dies, the thawed node learns it
/// from its link or liveness connection, and every (slot, index) still
/// arrives, resumed from the acknowledged prefix.
#[test]
fn a_node_frozen_past_the_retry_budget_relinks_and_loses_no_record() {
    let Some(mut net) = net_or_skip("freeze") else {
        return;
    };
    let (slots, records) = (16, 600);
    let (relay, mut b, mut a) = paced_pair_under_way(&mut net, 0xf7ee, slots, records);
    let (up, pause) = (Duration::from_secs(15), Duration::from_millis(600));
    // The sender's SENDs go unanswered past the budget.
    freeze(&b, pause);
    let before = b.progress();
    b.wait_for("records after the receiver's pause", up, |e| {
        e["event"] == "progress" && e["records"].as_u64() > Some(before + slots * 20)
    });
    // The receiver's acknowledgements (every 250 ms) go unanswered.
    freeze(&a, pause);
    assert_resumed("freeze", &mut b, &mut a, &relay, slots, records);
}

/// Partitions flapping on the impaired path, each cut 0.3–0.8 s (past the
/// RC retry budget) and each heal 0.5–2 s, from a seeded RNG, for
/// `QPMUX_FAULTS_FLAP_S` seconds (15): epoch after epoch dies and comes
/// back, and every slot's streams stay clean on both sides. A stall fails
/// it at once: an idle producer that never saw its epoch die once left both
/// nodes waiting for a link nobody asked for (docs/faults.md).
#[test]
fn flapping_partitions_kill_epoch_after_epoch_and_every_stream_stays_clean() {
    let Some(mut net) = net_or_skip("cuts") else {
        return;
    };
    let flap = Duration::from_secs(env_u64("QPMUX_FAULTS_FLAP_S", 15));
    let seed = env_u64("QPMUX_FAULTS_SEED", 0x5eed);
    let slots = 16;
    let relay = spawn_relay(&mut net, seed);
    // The senders stop 10 s after the flapping does: time to relink and finish.
    let args = paced(slots, flap.as_secs() + 10);
    let mut b = net.spawn('b', "b", &net.soak('b', &args));
    let mut a = net.spawn('a', "a", &net.soak('a', &args));
    b.wait_for("records", Duration::from_secs(15), |e| {
        e["event"] == "progress" && e["records"].as_u64() > Some(slots * 10)
    });
    let mut rng = SmallRng::seed_from_u64(seed);
    let until = Instant::now() + flap;
    let mut cuts = 0;
    while Instant::now() < until {
        if let Some(stall) = b.of_kind("stall").first() {
            panic!("stalled after {cuts} cuts: {stall}");
        }
        net.script(&["partition", "on"]).expect("partition");
        std::thread::sleep(Duration::from_millis(rng.random_range(300..800)));
        net.script(&["partition", "off"]).expect("heal");
        cuts += 1;
        std::thread::sleep(Duration::from_millis(rng.random_range(500..2000)));
    }
    eprintln!("flapping: {cuts} cuts");
    verdicts_after_deaths("flapping", &mut b, &mut a, &relay);
}

/// The receiver's last words lost as they leave: once the sender has queued
/// every record, B's packets to A are cut for 6 s (the relay delays every
/// datagram 400 ms, so the last records still reach B, and its final
/// acknowledgements, leaving B 400 ms after `all_sent`, meet the cut). Both
/// epochs die with those words unheard.
/// The receiver must not leave before the sender says it heard them: it
/// waits, sends them again on the epoch after the heal, and both exit with
/// every record verified once.
#[test]
fn the_receivers_last_words_lost_at_the_end_are_sent_again_before_it_leaves() {
    let Some(mut net) = net_or_skip("words") else {
        return;
    };
    let (slots, records) = (4u64, 8u64);
    let relay = spawn_relay_with(&mut net, &["--delay-us", "400000"]);
    let mut args = paced(slots, 40);
    set_arg(&mut args, "--records", &records.to_string());
    // A few batches a second (the slots' records mostly share one): far
    // under what the 32 receive credits and the 16 send buffers (freed as
    // B's ACKs come back) carry per 800 ms round trip, so no record waits
    // for either when the cut stops their return. At 100 ms and 300 ms of
    // delay one slot's last batch once did, and its stream died instead.
    set_arg(&mut args, "--pace-us", "250000");
    // ACK timeouts of 1.07 s against the 800 ms round trip, four tries:
    // RC gives up within the cut.
    set_arg(&mut args, "--rc-timeout", "18");
    // A dial in flight at the heal may wait out a SYN retransmission.
    args.extend(strings(&["--linger-s", "20"]));
    let mut b = net.spawn('b', "b", &net.soak('b', &args));
    let mut a = net.spawn('a', "a", &net.soak('a', &args));
    a.wait_for("every record queued", Duration::from_secs(30), |e| {
        e["event"] == "all_sent"
    });
    net.script(&["partition", "b-to-a"]).expect("one-way cut");
    std::thread::sleep(Duration::from_secs(6));
    net.script(&["partition", "off"]).expect("heal");
    let b_verdict = b.verdict(Duration::from_secs(30));
    let a_verdict = a.verdict(Duration::from_secs(30));
    let relay_stats = stop_relay(&relay);
    eprintln!("words: receiver {b_verdict}\nsender {a_verdict}\nrelay {relay_stats}");
    assert_clean("receiver", &b_verdict);
    assert_clean("sender", &a_verdict);
    // Every stream ended in the first epoch; what the cut took was the
    // words that said so.
    assert_eq!(count(&b_verdict, "streams"), slots, "{b_verdict}");
    assert_eq!(count(&b_verdict, "dropped"), 0, "{b_verdict}");
    assert!(count(&b_verdict, "epoch_deaths") > 0, "{b_verdict}");
    assert_eq!(
        count(&b_verdict, "records_unique"),
        slots * records,
        "{b_verdict}"
    );
    assert_eq!(b_verdict["sender_done"], true, "{b_verdict}");
    assert_eq!(a_verdict["receiver_heard_done"], true, "{a_verdict}");
}
