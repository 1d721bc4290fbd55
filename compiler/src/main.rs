//! The `waferc` command-line tool. Each subcommand lives in `waferc::commands`.

use std::process::ExitCode;

use clap::Parser;
use waferc::commands::Cli;

fn main() -> ExitCode {
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
