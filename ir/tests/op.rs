//! `Op`'s handle accessors and `Op::remap`, which passes use to rebuild modules.

mod common;

use waferc_ir::{Handle, Op};

#[test]
fn remap_with_identity_maps_is_the_identity() {
    for module in [common::dense(), common::moe()] {
        for (_, instr) in module.body.iter() {
            assert_eq!(instr.op.remap(|v| v, |w| w, |c| c), instr.op);
        }
    }
}

#[test]
fn remap_moves_every_handle_and_nothing_else() {
    let shift_value = |v: waferc_ir::Value| Handle::new(v.index() + 100);
    for module in [common::dense(), common::moe()] {
        for (_, instr) in module.body.iter() {
            let op = &instr.op;
            let moved = op.remap(shift_value, |w| Handle::new(w.index() + 200), |c| Handle::new(c.index() + 300));
            assert_eq!(moved.name(), op.name());
            let operands: Vec<usize> = op.operands().iter().map(|v| v.index() + 100).collect();
            assert_eq!(moved.operands().iter().map(|v| v.index()).collect::<Vec<_>>(), operands);
            let weights: Vec<usize> = op.weights().iter().map(|w| w.index() + 200).collect();
            assert_eq!(moved.weights().iter().map(|w| w.index()).collect::<Vec<_>>(), weights);
            assert_eq!(moved.cache().map(|c| c.index()), op.cache().map(|c| c.index() + 300));
            // Undoing the shift restores the op, so no attribute was touched.
            let back = moved.remap(
                |v| Handle::new(v.index() - 100),
                |w| Handle::new(w.index() - 200),
                |c| Handle::new(c.index() - 300),
            );
            assert_eq!(&back, op);
        }
    }
}

#[test]
fn only_attention_has_a_cache() {
    let module = common::dense();
    let with_cache: Vec<&str> =
        module.body.iter().filter(|(_, i)| i.op.cache().is_some()).map(|(_, i)| i.op.name()).collect();
    assert_eq!(with_cache, ["attention", "attention"]);
    assert!(matches!(module.body.iter().find(|(_, i)| i.op.cache().is_some()).unwrap().1.op, Op::Attention { .. }));
}
