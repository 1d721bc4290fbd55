//! The `waferc` command-line tool. Each subcommand lives in `waferc::commands`.

use std::process::ExitCode;

use clap::Parser;
use waferc::commands::Cli;

fn main() -> ExitCode {
    restore_sigpipe();
    one_malloc_arena();
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

/// glibc gives each thread a malloc arena of its own and keeps what a thread frees there. The
/// placement checker runs half its work on a rayon worker, and the plan search then lowers the
/// next candidate on the main thread, which cannot reuse that memory: the 8B search peaked at
/// 4.92 GB with an arena per thread, 3.66 GB with one (4.14 GB trimming after each check).
/// waferc allocates on one thread almost everywhere, so one arena costs it no contention.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: called first thing in main, before any thread exists; M_ARENA_MAX is a valid option.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
