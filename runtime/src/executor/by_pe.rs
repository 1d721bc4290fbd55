//! Items grouped by the PE they concern, each PE's in the order given: one hash entry per PE
//! and one flat list. The executor looks things up by PE once per tile (a tile's input
//! segments, its operand routes, a reduction leaf's tile), and a wide matvec has hundreds of
//! thousands of tiles: a scan per lookup, a list per PE, or a binary search over every item
//! each cost too much there.

use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;

use waferc_ir::wafer::Pe;

pub(crate) struct ByPe<T> {
    /// Per PE, its run of `items`.
    runs: HashMap<Pe, Range<u32>>,
    items: Vec<T>,
}

impl<T: Copy + Default> ByPe<T> {
    /// Groups `items` by PE, keeping their order within each PE: counted first, then filled,
    /// so nothing is sorted.
    pub(crate) fn new(items: impl Iterator<Item = (Pe, T)> + Clone) -> Self {
        let mut runs: HashMap<Pe, Range<u32>> = HashMap::default();
        for (pe, _) in items.clone() {
            runs.entry(pe).or_insert(0..0).end += 1;
        }
        let mut total = 0;
        for run in runs.values_mut() {
            let count = run.end;
            *run = total..total;
            total += count;
        }
        let mut grouped = vec![T::default(); total as usize];
        for (pe, item) in items {
            if let Some(run) = runs.get_mut(&pe) {
                grouped[run.end as usize] = item;
                run.end += 1;
            }
        }
        ByPe { runs, items: grouped }
    }

    /// The items of `pe`, in the order given.
    pub(crate) fn on(&self, pe: Pe) -> &[T] {
        self.runs.get(&pe).map_or(&[], |run| &self.items[run.start as usize..run.end as usize])
    }
}
