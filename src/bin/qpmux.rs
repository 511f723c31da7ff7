//! `qpmux`: see `qpmux --help`; with no arguments, the demo.

fn main() -> anyhow::Result<()> {
    qpmux::cli::main()
}
