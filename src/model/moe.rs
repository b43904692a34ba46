//! Mixture-of-experts routing, as llama.cpp's `build_moe_ffn` does it for the softmax-gated
//! families: each token's router logits (one fixed order of sums, whatever else is in the
//! pass), their softmax, the `n_used` most likely experts (ties to the lower index), and their
//! weights, renormalised to sum to 1 where the family does. The experts' products themselves
//! run in [`super::layer`], on whichever backend.

use super::config::{ExpertGroups, Gating, MoeCfg};

/// llama.cpp's floor on the sum the chosen weights are divided by (2^-14).
const NORM_FLOOR: f32 = 6.103_515_6e-5;

/// Gemma 4's router input for each row of `x` (rows of `scale.len()`): the row over its root
/// mean square (plus `eps`), times 1/sqrt(d) and `scale`.
pub fn gemma4_router_rows(x: &[f32], scale: &[f32], eps: f32) -> Vec<f32> {
    let d = scale.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|v| (v * v) as f64).sum::<f64>() / d as f64;
        let f = (1.0 / (ms + eps as f64).sqrt()) as f32 / (d as f32).sqrt();
        out.extend(row.iter().zip(scale).map(|(v, s)| v * f * s));
    }
    out
}

/// `out[e]` = row `e` of `router` (E rows of `x.len()`) · `x`, each summed in one fixed order
/// (eight running lanes, then the lanes in order), so a token's logits are the same bits in
/// any pass.
pub fn router_logits(router: &[f32], x: &[f32], out: &mut [f32]) {
    let d = x.len();
    for (o, row) in out.iter_mut().zip(router.chunks_exact(d)) {
        let mut lanes = [0f32; 8];
        let mut rc = row.chunks_exact(8);
        let mut xc = x.chunks_exact(8);
        for (r, v) in (&mut rc).zip(&mut xc) {
            // Plain multiply and add (not `mul_add`: without FMA in the target that is a
            // libm call per value), which the compiler vectorises as written.
            for i in 0..8 {
                lanes[i] += r[i] * v[i];
            }
        }
        let mut sum = 0f32;
        for (r, v) in rc.remainder().iter().zip(xc.remainder()) {
            sum += r * v;
        }
        for l in lanes {
            sum += l;
        }
        *o = sum;
    }
}

/// One token's experts from its router `logits` (biased already, where the router has a
/// bias): appends (expert, weight) for each of the `n_used` chosen, most likely first.
/// `selection_bias`: added to the probabilities for the choice alone.
pub fn route(
    logits: &[f32],
    cfg: &MoeCfg,
    selection_bias: Option<&[f32]>,
    sel: &mut Vec<(u32, f32)>,
) {
    let p = match cfg.gating {
        Gating::Softmax => softmax(logits),
        Gating::SoftmaxWeight => logits.to_vec(),
        Gating::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let mut choose: Vec<f32> = match selection_bias {
        Some(b) => p.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => p.clone(),
    };
    if let Some(g) = cfg.groups {
        keep_best_groups(&mut choose, g);
    }
    let order = descending(&choose);
    let chosen = &order[..cfg.n_used.min(order.len())];
    let mut w: Vec<f32> = chosen.iter().map(|&e| p[e as usize]).collect();
    if cfg.gating == Gating::SoftmaxWeight {
        w = softmax(&w);
    }
    if cfg.norm_weights {
        let s = w.iter().map(|&v| f64::from(v)).sum::<f64>() as f32;
        let s = s.max(NORM_FLOOR);
        for v in &mut w {
            *v /= s;
        }
    }
    if cfg.weights_scale != 0.0 && cfg.weights_scale != 1.0 {
        for v in &mut w {
            *v *= cfg.weights_scale;
        }
    }
    sel.extend(chosen.iter().copied().zip(w));
}

/// Indices of `v` from the highest value down, ties to the lower index.
fn descending(v: &[f32]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..v.len() as u32).collect();
    order.sort_by(|&a, &b| {
        v[b as usize]
            .partial_cmp(&v[a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    order
}

/// Group-limited routing, as llama.cpp's `build_moe_ffn` masks the choice: the experts in
/// `g.count` consecutive groups, each scored by the sum of its two highest values; every
/// expert outside the `g.used` best groups set to minus infinity.
fn keep_best_groups(choose: &mut [f32], g: ExpertGroups) {
    let per = choose.len() / g.count;
    let scores: Vec<f32> = choose
        .chunks_exact(per)
        .map(|group| {
            let top = descending(group);
            group[top[0] as usize] + group[top[1] as usize]
        })
        .collect();
    let best = descending(&scores);
    for &group in &best[g.used..] {
        let at = group as usize * per;
        choose[at..at + per].fill(f32::NEG_INFINITY);
    }
}

/// exp(x - max) / their sum (summed in f64, as ggml's softmax sums).
fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut p: Vec<f32> = x.iter().map(|&l| (l - max).exp()).collect();
    let sum: f64 = p.iter().map(|&v| f64::from(v)).sum();
    let inv = (1.0 / sum) as f32;
    for v in &mut p {
        *v *= inv;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Need, SharedExpert};

    fn cfg(n_used: usize, norm_weights: bool) -> MoeCfg {
        MoeCfg {
            n_expert: 4,
            n_used,
            ff: 8,
            norm_weights,
            scales: false,
            shared_scales: false,
            gate: Need::Required,
            shared: SharedExpert::None,
            gating: Gating::Softmax,
            biases: false,
            selection_bias: Need::Absent,
            weights_scale: 0.0,
            dense_lead: 0,
            groups: None,
        }
    }

    #[test]
    fn groups_limit_the_choice_to_the_best_groups_by_their_top_two() {
        // Eight experts in four groups of two, scoring 0.9, 1.0, 0.85 and 0.8: with two
        // groups used, groups 1 and 0 keep their experts.
        let p = [0.9f32, 0.0, 0.5, 0.5, 0.8, 0.05, 0.4, 0.4];
        let mut c = cfg(2, false);
        c.n_expert = 8;
        c.gating = Gating::SoftmaxWeight;
        c.groups = Some(ExpertGroups { count: 4, used: 2 });
        let mut choose = p.to_vec();
        keep_best_groups(&mut choose, c.groups.unwrap());
        let kept: Vec<usize> = (0..8).filter(|&e| choose[e].is_finite()).collect();
        assert_eq!(kept, [0, 1, 2, 3]);
        // Without groups the two highest are experts 0 and 4; with them, 0 and 2 (4's group
        // scores 0.85).
        let mut sel = Vec::new();
        route(&p, &c, None, &mut sel);
        assert_eq!(sel.iter().map(|s| s.0).collect::<Vec<_>>(), [0, 2]);
        c.groups = None;
        sel.clear();
        route(&p, &c, None, &mut sel);
        assert_eq!(sel.iter().map(|s| s.0).collect::<Vec<_>>(), [0, 4]);
    }

    #[test]
    fn softmax_top_k_and_renormalised_weights() {
        let logits = [0.0f32, 2.0, 1.0, 2.0];
        let e: Vec<f64> = logits.iter().map(|&l| (f64::from(l) - 2.0).exp()).collect();
        let total: f64 = e.iter().sum();
        let mut sel = Vec::new();
        route(&logits, &cfg(2, false), None, &mut sel);
        // Ties go to the lower index: 1 before 3.
        assert_eq!(sel.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 3]);
        assert!((f64::from(sel[0].1) - e[1] / total).abs() < 1e-6);
        sel.clear();
        route(&logits, &cfg(3, true), None, &mut sel);
        assert_eq!(sel.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 3, 2]);
        let sum: f32 = sel.iter().map(|s| s.1).sum();
        assert!((sum - 1.0).abs() < 1e-6, "{sel:?}");
        assert!((f64::from(sel[2].1) - e[2] / (e[1] + e[3] + e[2])).abs() < 1e-6);
    }

    /// gpt-oss: the top k of the raw logits, then a softmax over those k alone.
    #[test]
    fn softmax_weight_gating_takes_the_top_logits_then_their_softmax() {
        let logits = [0.5f32, 3.0, -1.0, 2.0];
        let mut c = cfg(2, false);
        c.gating = Gating::SoftmaxWeight;
        let mut sel = Vec::new();
        route(&logits, &c, None, &mut sel);
        assert_eq!(sel.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 3]);
        let want = 1.0 / (1.0 + (-1.0f64).exp());
        assert!((f64::from(sel[0].1) - want).abs() < 1e-6, "{sel:?}");
        assert!((f64::from(sel[1].1) - (1.0 - want)).abs() < 1e-6, "{sel:?}");
    }

    /// Sigmoid gating with a selection bias (dots.llm1): the bias decides the choice, the
    /// weights are the unbiased sigmoids, renormalised and scaled.
    #[test]
    fn sigmoid_gating_chooses_by_the_biased_probabilities() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let mut c = cfg(2, true);
        c.gating = Gating::Sigmoid;
        c.weights_scale = 2.5;
        let bias = [0.0f32, 0.0, 0.9, 0.0];
        let mut sel = Vec::new();
        route(&logits, &c, Some(&bias), &mut sel);
        assert_eq!(sel.iter().map(|s| s.0).collect::<Vec<_>>(), [2, 0]);
        let s = |x: f64| 1.0 / (1.0 + (-x).exp());
        let (a, b) = (s(0.0), s(2.0));
        assert!(
            (f64::from(sel[0].1) - 2.5 * a / (a + b)).abs() < 1e-6,
            "{sel:?}"
        );
        assert!(
            (f64::from(sel[1].1) - 2.5 * b / (a + b)).abs() < 1e-6,
            "{sel:?}"
        );
    }

    #[test]
    fn router_logits_are_the_dot_products() {
        let d = 19;
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        let router: Vec<f32> = (0..3 * d).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = [0f32; 3];
        router_logits(&router, &x, &mut out);
        for (e, o) in out.iter().enumerate() {
            let want: f64 = (0..d)
                .map(|i| f64::from(router[e * d + i]) * f64::from(x[i]))
                .sum();
            assert!((f64::from(*o) - want).abs() < 1e-5, "{o} {want}");
        }
    }
}
