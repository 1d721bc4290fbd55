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
            let mut said = error.to_string();
            eprintln!("error: {said}");
            // Many errors name their cause in their own message already; say each thing once.
            for cause in error.chain().skip(1) {
                let text = cause.to_string();
                if !said.contains(&text) {
                    eprintln!("  caused by: {text}");
                    said.push_str(&text);
                }
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
