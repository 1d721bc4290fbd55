//! Expert lanes: how a region's tile area is shared among the experts of an MoE block.
//!
//! The experts of a layer run side by side, each in a *lane*, a rectangle of the area, so the
//! routes of experts in different lanes (which may be active together) need no colours from
//! each other. A lane holds one expert, or `experts_per_lane` of them (`Plan::Stacked`): each
//! is then spread over that many times the PEs, and two chosen experts of one lane run one
//! after the other on them.
//!
//! Lanes are bands of rows, cut across into `across` columns of lanes. Full-width bands are the
//! fewest routes across the area, but a band of a few rows folds each matrix into many
//! interleaved panels, whose reductions queue on the band's row links (Qwen3-30B-A3B's 128
//! experts in bands of two or three rows: 5.8k of a layer's 38k cycles waiting in the experts'
//! reductions). So the columns of lanes are chosen by the experts' tilings' estimated cost,
//! charged for those interleaved reductions too. Any count may win, not only a power of two: a
//! tiling uses column blocks times panels of a lane's width, so the width decides how much of
//! the lane computes (Qwen3-30B-A3B on a 240-column region: ten columns of lanes 24 wide beat
//! eight of 30, whose gate/up used 24 columns; 791.9 -> 835.2 tok/s).

use super::grid::{panel_cap, Grid, PanelLayout, Span};
use super::regions::Rect;

/// The fewest rows of an expert's lane while the area's width can be cut into columns of lanes
/// ([`lane_columns`]), and the fewest columns such a lane keeps. With one-row lanes beside
/// two-row ones an expert's tiles held twice another's bytes a PE (Qwen3-30B-A3B's 128 experts
/// at `stacked:1` overflowed a PE).
const MIN_LANE_ROWS: u64 = 2;
const MIN_LANE_COLUMNS: u64 = 16;

/// Expert `expert`'s lane among `experts` lanes of `area` in `across` columns of lanes, and the
/// number of lanes (at most `experts`).
pub(super) fn lane(area: Rect, experts: u64, across: u64, expert: u64) -> (Rect, u64) {
    let bands = experts.div_ceil(across).clamp(1, area.h as u64);
    let lanes = (across * bands).min(experts.max(1));
    let lane = expert % lanes;
    (area.band(lane % bands, bands).column(lane / bands, across), lanes)
}

/// The columns of lanes for `experts` experts over `area`, each expert's matrices of `shapes`
/// (rows, columns, panel layout): among the column counts whose lanes keep [`MIN_LANE_ROWS`] rows and
/// [`MIN_LANE_COLUMNS`] columns, the one whose lanes tile the matrices at the least
/// [`lane_cost`] (ties: fewer columns). With no such count, as many columns as the width holds.
pub(super) fn lane_columns(area: Rect, experts: u64, shapes: &[(u64, u64, PanelLayout)]) -> u64 {
    let (w, h) = (area.w as u64, area.h as u64);
    let most = (w / MIN_LANE_COLUMNS).max(1);
    (1..=most)
        .filter(|&across| h / experts.div_ceil(across) >= MIN_LANE_ROWS)
        .filter_map(|across| {
            let (rect, _) = lane(area, experts, across, 0);
            let cost: Option<u64> = shapes.iter().map(|&shape| lane_cost(shape, rect)).sum();
            cost.map(|cost| (cost, across))
        })
        .min()
        .map_or(most, |(_, across)| across)
}

/// The least estimated cycles of a `rows x cols` matrix tiled over `lane` in panels laid out as
/// `layout` ([`Grid::cost`], its interleaved reductions' queueing included). `None` when no
/// tiling fits the lane's width.
fn lane_cost((rows, cols, layout): (u64, u64, PanelLayout), lane: Rect) -> Option<u64> {
    let span = Span { area: lane, max_panels: panel_cap(rows, lane.h as u64), layout };
    Grid::candidates(rows, cols, span).map(|g| g.cost(lane)).min()
}

#[cfg(test)]
mod tests {
    use super::PanelLayout::{Interleaved, SideBySide};
    use super::*;

    fn area(w: u16, h: u16) -> Rect {
        Rect { wafer: 0, x: 0, y: 0, w, h }
    }

    #[test]
    fn lanes_partition_the_experts_without_overlap() {
        let area = area(64, 40);
        for across in [1, 2, 3, 4, 5] {
            let rects: Vec<Rect> = (0..16).map(|e| lane(area, 16, across, e).0).collect();
            for (a, ra) in rects.iter().enumerate() {
                assert!(ra.x + ra.w <= 64 && ra.y + ra.h <= 40, "{ra:?}");
                for rb in &rects[a + 1..] {
                    let apart =
                        ra.x + ra.w <= rb.x || rb.x + rb.w <= ra.x || ra.y + ra.h <= rb.y || rb.y + rb.h <= ra.y;
                    assert!(apart, "{ra:?} and {rb:?} overlap ({across} across)");
                }
            }
        }
    }

    #[test]
    fn many_small_experts_take_lanes_cut_across_and_few_large_ones_keep_wide_bands() {
        // Qwen3-30B-A3B's experts (gate/up 1536 x 2048, down 2048 x 768), 128 of them on a
        // 224 x 288 area: two-row bands would interleave seven panels a row.
        let qwen = [(1536, 2048, SideBySide), (2048, 768, Interleaved)];
        assert!(lane_columns(area(224, 288), 128, &qwen) > 1);
        // Mixtral's down projection (4096 x 14336: at least 56 column blocks, at eight chunks a
        // tile) folds into few panels in narrow lanes: never more than two columns of lanes on 370.
        let mixtral = [(28672, 4096, SideBySide), (4096, 14336, Interleaved)];
        assert!(lane_columns(area(370, 292), 8, &mixtral) <= 2);
    }

    /// The column counts are not only powers of two: Qwen3-30B-A3B's 128 experts on a 240 x 288
    /// region tile best in lanes of a width no power of two gives.
    #[test]
    fn lane_columns_need_not_be_a_power_of_two() {
        let (qwen, area) = ([(1536, 2048, SideBySide), (2048, 768, Interleaved)], area(240, 288));
        let cost = |across| {
            let rect = lane(area, 128, across, 0).0;
            qwen.iter().map(|&shape| lane_cost(shape, rect)).sum::<Option<u64>>()
        };
        let across = lane_columns(area, 128, &qwen);
        let best_power = [1, 2, 4, 8].into_iter().filter_map(cost).min().unwrap();
        assert!(!across.is_power_of_two() && cost(across).unwrap() < best_power, "{across} columns");
    }
}
