//! Passes over the tensor IR and the lowering from IR to a wafer placement.
