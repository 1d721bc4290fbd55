//! Routing profiles: how often a model's MoE routers pick each expert, and each pair of experts
//! together, over some prompts. `waferc profile` records one from the reference decoder; the
//! placer orders experts by it (`passes::wafer::experts`); the artifact stores it, `inspect`
//! shows it as expert heat, and a `--timing-only` run draws each step's picks from it (from a
//! uniform router's without one: [`timing_picks`]).

use serde::{Deserialize, Serialize};

/// Router statistics of every MoE layer of a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingProfile {
    /// Where the statistics come from (the prompt file, or how they were generated).
    pub source: String,
    /// One per MoE layer, in layer order.
    pub layers: Vec<LayerProfile>,
}

/// One MoE layer's router statistics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerProfile {
    pub layer: u32,
    pub experts: u32,
    pub top_k: u32,
    /// Routing decisions recorded (one per token position run).
    pub tokens: u64,
    /// Per expert: how many decisions picked it.
    pub picks: Vec<u64>,
    /// `experts x experts`, row-major and symmetric: how many decisions picked both `i` and `j`
    /// (the diagonal is zero).
    pub pairs: Vec<u64>,
}

impl RoutingProfile {
    pub fn layer(&self, layer: u32) -> Option<&LayerProfile> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// The first inconsistency, as a sentence naming the layer and field.
    pub fn problem(&self) -> Option<String> {
        for l in &self.layers {
            let n = l.experts as usize;
            let at = format!("layer {}", l.layer);
            if l.top_k == 0 || l.top_k > l.experts {
                return Some(format!("{at}: top_k {} of {} experts", l.top_k, l.experts));
            }
            if l.picks.len() != n {
                return Some(format!("{at}: picks has {} entries for {n} experts", l.picks.len()));
            }
            if l.pairs.len() != n * n {
                return Some(format!("{at}: pairs has {} entries, expected {n} x {n}", l.pairs.len()));
            }
            if l.picks.iter().sum::<u64>() != l.tokens * l.top_k as u64 {
                return Some(format!(
                    "{at}: picks sum to {}, but {} tokens of top {} make {}",
                    l.picks.iter().sum::<u64>(),
                    l.tokens,
                    l.top_k,
                    l.tokens * l.top_k as u64
                ));
            }
        }
        let mut layers: Vec<u32> = self.layers.iter().map(|l| l.layer).collect();
        layers.dedup();
        (layers.len() != self.layers.len() || !layers.is_sorted())
            .then(|| "layers must be listed once each, in increasing order".to_string())
    }
}

/// The experts a `--timing-only` step charges in MoE layer `layer` at `position`: the profile's
/// expected picks for the layer ([`LayerProfile::expected_picks`]), or without one (or with one
/// recorded for another shape) a uniform router's, drawn the same way with equal weights. A
/// fixed choice, such as the first `top_k` experts, would favour whichever plan places those
/// experts well: experts sharing PEs, say, that it never picks together.
pub fn timing_picks(profile: Option<&RoutingProfile>, layer: u32, experts: u32, top_k: u32, position: u32) -> Vec<u32> {
    match profile.and_then(|p| p.layer(layer)) {
        Some(recorded) if recorded.experts == experts && recorded.top_k == top_k => recorded.expected_picks(position),
        _ => draw_picks(layer, vec![1; experts as usize], top_k.min(experts), position),
    }
}

/// Per MoE layer of `module`, the experts a `--timing-only` step at `position` runs
/// ([`timing_picks`] with the program's profile), as a predicate over (layer, expert): what
/// `bound::distance_bound_cycles` asks of the step it bounds.
pub fn timing_only_experts(
    module: &crate::Module,
    profile: Option<&RoutingProfile>,
    position: u32,
) -> impl Fn(u32, u32) -> bool {
    let mut chosen: std::collections::HashMap<u32, Vec<u32>> = std::collections::HashMap::new();
    for (_, instr) in module.body.iter() {
        if let (crate::ValueType::Routing { experts, top_k }, Some(layer)) = (&instr.ty, instr.layer) {
            chosen.insert(layer, timing_picks(profile, layer, *experts, *top_k, position));
        }
    }
    move |layer, expert| chosen.get(&layer).is_some_and(|picks| picks.contains(&expert))
}

impl LayerProfile {
    /// An empty profile of a layer, for recording.
    pub fn new(layer: u32, experts: u32, top_k: u32) -> Self {
        let n = experts as usize;
        LayerProfile { layer, experts, top_k, tokens: 0, picks: vec![0; n], pairs: vec![0; n * n] }
    }

    /// Counts one routing decision.
    pub fn record(&mut self, chosen: &[u32]) {
        let n = self.experts as usize;
        self.tokens += 1;
        for (a, &i) in chosen.iter().enumerate() {
            self.picks[i as usize] += 1;
            for &j in &chosen[a + 1..] {
                self.pairs[i as usize * n + j as usize] += 1;
                self.pairs[j as usize * n + i as usize] += 1;
            }
        }
    }

    pub fn pair(&self, i: u32, j: u32) -> u64 {
        self.pairs[i as usize * self.experts as usize + j as usize]
    }

    /// Expert `e`'s share of the picks (the uniform share `top_k / experts` per token is
    /// `1 / experts` here).
    pub fn heat(&self, e: u32) -> f64 {
        let total: u64 = self.picks.iter().sum();
        match total {
            0 => 1.0 / self.experts as f64,
            t => self.picks[e as usize] as f64 / t as f64,
        }
    }

    /// Whether every expert was picked equally often (or never): placement has nothing to go on.
    pub fn is_uniform(&self) -> bool {
        self.picks.windows(2).all(|w| w[0] == w[1])
    }

    /// The experts a `--timing-only` step at `position` charges: `top_k` distinct experts drawn
    /// without replacement in proportion to their picks (plus one, so an unpicked expert can
    /// still come up), from a hash of the layer and position, so over many steps each expert's
    /// share approaches its profile share and every run is reproducible. Increasing order.
    pub fn expected_picks(&self, position: u32) -> Vec<u32> {
        draw_picks(self.layer, self.picks.iter().map(|p| p + 1).collect(), self.top_k, position)
    }
}

/// `top_k` distinct experts drawn without replacement in proportion to `weights`, from a hash of
/// the layer, the position and the draw; increasing order.
fn draw_picks(layer: u32, mut weights: Vec<u64>, top_k: u32, position: u32) -> Vec<u32> {
    let mut chosen = Vec::with_capacity(top_k as usize);
    for draw in 0..top_k as u64 {
        let total: u64 = weights.iter().sum();
        let seed = (layer as u64) << 40 ^ (position as u64) << 8 ^ draw;
        let mut ticket = splitmix64(seed) % total.max(1);
        let mut pick = 0;
        for (e, &w) in weights.iter().enumerate() {
            if ticket < w {
                pick = e;
                break;
            }
            ticket -= w;
        }
        weights[pick] = 0;
        chosen.push(pick as u32);
    }
    chosen.sort_unstable();
    chosen
}

/// SplitMix64 (Steele, Lea, Flood 2014): a fixed, well-mixed hash of a 64-bit counter.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_picks_follow_the_profile() {
        let mut layer = LayerProfile::new(3, 8, 2);
        for _ in 0..90 {
            layer.record(&[1, 6]);
        }
        for _ in 0..10 {
            layer.record(&[0, 2]);
        }
        let mut seen = [0u32; 8];
        for position in 0..1000 {
            let picks = layer.expected_picks(position);
            assert_eq!(picks.len(), 2);
            assert!(picks[0] < picks[1]);
            for e in picks {
                seen[e as usize] += 1;
            }
        }
        assert!(seen[1] > 800 && seen[6] > 800, "{seen:?}");
        assert!(seen[3] < 100, "{seen:?}");
        assert_eq!(layer.pair(1, 6), 90);
        assert_eq!(layer.pair(6, 1), 90);
        let profile = RoutingProfile { source: "t".into(), layers: vec![layer] };
        assert_eq!(profile.problem(), None);
    }
}
