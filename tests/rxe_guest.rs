//! Kernel soft-RoCE parity: boots Debian's kernel in QEMU, creates `rxe0`, and
//! runs the provider-generic verbs suite (`tests/verbs_ibv.rs`), the link
//! suite (`tests/link_ibv.rs`) and `qpmux pingpong --provider ibverbs` against
//! it through the libibverbs provider (`tests/rxe/run.sh`, docs/rxe.md). The
//! guest's verdict is this test's verdict.
//!
//! Skips, printing why, without `--features ibverbs`, with `QPMUX_RXE=0`, or
//! when QEMU, the host packages or the kernel package cannot be had. Set
//! `QPMUX_RXE=1` to turn a skip into a failure (CI).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The newest test executable `name-*` cargo built next to this one whose
/// `--list` names `probe` (a binary built without the feature lists none).
fn sibling_test_binary(name: &str, probe: &str) -> Option<PathBuf> {
    let me = std::env::current_exe().ok()?;
    let dir = me.parent()?;
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{name}-")) && !n.contains('.'))
        })
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .collect();
    found.sort();
    found.into_iter().rev().map(|(_, p)| p).find(|p| {
        Command::new(p)
            .arg("--list")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(probe))
    })
}

#[test]
fn verbs_suite_on_kernel_rxe_in_qemu() {
    let required = std::env::var("QPMUX_RXE").is_ok_and(|v| v == "1");
    let skip = |why: &str| {
        assert!(
            !required,
            "QPMUX_RXE=1 but the rxe run cannot happen: {why}"
        );
        eprintln!("skipping verbs_suite_on_kernel_rxe_in_qemu: {why}");
    };
    if std::env::var("QPMUX_RXE").is_ok_and(|v| v == "0") {
        return skip("QPMUX_RXE=0");
    }
    if !cfg!(feature = "ibverbs") {
        return skip("built without --features ibverbs");
    }
    let Some(bin) = sibling_test_binary("verbs_ibv", "ping_pong: test") else {
        return skip("the verbs_ibv test binary is not built (cargo test --features ibverbs)");
    };
    let Some(link_bin) = sibling_test_binary("link_ibv", "many_slots_in_order_without_rnr: test")
    else {
        return skip("the link_ibv test binary is not built (cargo test --features ibverbs)");
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rxe/run.sh");
    let out = Command::new("bash")
        .arg(&script)
        .env("RXE_TEST_BIN", &bin)
        .env("RXE_LINK_BIN", &link_bin)
        .env("RXE_QPMUX_BIN", env!("CARGO_BIN_EXE_qpmux"))
        .output()
        .expect("run tests/rxe/run.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprint!("{stderr}");
    match out.status.code() {
        Some(0) => {}
        Some(77) => skip(
            stderr
                .lines()
                .find_map(|l| l.strip_prefix("SKIP: "))
                .unwrap_or("tests/rxe/run.sh skipped"),
        ),
        other => panic!("the guest run failed on kernel rxe (run.sh exit {other:?}); see above"),
    }
}
