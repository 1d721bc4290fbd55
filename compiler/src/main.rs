//! The `waferc` command-line tool. Each subcommand lives in `waferc::commands`.

use std::process::ExitCode;

use clap::Parser;
use waferc::commands::Cli;

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    match waferc::commands::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            for cause in error.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Rust ignores SIGPIPE, which turns `waferc inspect big.wafer | head` into a panic inside
/// `println!`; a command-line tool should end quietly as other Unix tools do.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in main, before any thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
