//! The waferc driver: checkpoint frontends and the command-line tool's commands.

pub mod commands;
pub mod frontend;
pub mod inspect;
pub mod plan_search;
pub mod replica_choice;
pub mod synth;
