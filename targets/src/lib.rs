//! Wafer targets.
