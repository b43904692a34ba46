//! Rotary position embeddings of every kind in use, computed as ggml computes them: plain,
//! linear scaling (a factor on every angle), YaRN (interpolated and extrapolated angles mixed
//! by a ramp over the pairs, and a magnitude factor), per-pair frequency factors (Llama 3's
//! `rope_freqs`, long-rope's long and short factors), and partial rotary (only the first
//! `n_rot` values of each head turn), with ggml's YaRN ramp, magnitude and factor order (a
//! pair's angle divided by its factor, then scaled). One difference, chosen by measurement:
//! ggml forms pair i's frequency as a running product (base^(-2/n) multiplied i times), gen
//! as base^(-2i/n) directly, as gen always has. The two differ in the last bits of the angles;
//! on llama.cpp's architecture suite and the rope tests both give the same agreement (NMSE
//! to llama.cpp's logits equal to two digits, about 1e-9), and the direct form keeps the
//! greedy agreement with llama.cpp recorded on the real models (SmolLM2 Q5_K_M 128 of 132
//! steps against 125, Gemma 3 270M 141 of 144 against 140).

/// Which values of a head rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePairs {
    /// Neighbours (2i, 2i + 1): llama.cpp's NORM, for llama GGUFs, whose converter permutes
    /// the q/k rows (and so does gen's safetensors loader, see `checkpoint`).
    Norm,
    /// The two halves of the rotated part (i, i + n_rot/2): llama.cpp's NEOX, Hugging Face's
    /// rotate-half.
    Neox,
}

/// Which of long-rope's frequency factors divide the angles (a file's `rope_freqs.weight`,
/// where it has one, divides every rotary embedding instead, as llama.cpp's
/// `get_rope_factors` takes it first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Factors {
    None,
    /// `rope_factors_long.weight`.
    Long,
    /// `rope_factors_short.weight`.
    Short,
}

/// Multimodal rope (Qwen2-VL's M-RoPE, Qwen3-VL's interleaved form) as it turns text: the
/// rotated pairs are dealt to sections (`rope.dimension_sections`: time, height, width, extra),
/// and llama.cpp gives a text token its position in the first three and 0 in the fourth, so
/// a pair dealt to the fourth (or to none) does not turn. Otherwise it is halves-paired rope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextMrope {
    pub sections: [u32; 4],
    /// Sections dealt in turn, pair by pair (IMROPE), not in runs (MROPE).
    pub interleaved: bool,
}

impl TextMrope {
    /// Whether pair `i` of the rotated part stays still for text, as ggml deals the pairs
    /// (`ggml_mrope_cache_init`: the pair's sector is i modulo the sections' sum).
    pub fn still(&self, i: usize) -> bool {
        let [t, h, w, _] = self.sections.map(|x| x as usize);
        let sector = i % self
            .sections
            .iter()
            .map(|&x| x as usize)
            .sum::<usize>()
            .max(1);
        if self.interleaved {
            let text = match sector % 3 {
                0 => sector < 3 * t,
                1 => sector < 3 * h,
                _ => sector < 3 * w,
            };
            !text
        } else {
            sector >= t + h + w
        }
    }
}

/// One rotary embedding, as llama.cpp's context resolves it (llama-context.cpp): the values
/// its graph passes to `ggml_rope_ext`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeCfg {
    /// How many of a head's values rotate (the rest pass through).
    pub n_rot: usize,
    pub base: f32,
    /// Angles are multiplied by this (1 / the linear or YaRN factor).
    pub freq_scale: f32,
    /// YaRN's mix of extrapolated angles (0: none).
    pub ext_factor: f32,
    /// cos and sin are multiplied by this (YaRN's and long-rope's magnitude).
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub n_ctx_orig: usize,
    pub factors: Factors,
    /// Multimodal rope's sections, where the file has them (see [`TextMrope`]).
    pub mrope: Option<TextMrope>,
}

impl RopeCfg {
    /// Plain rotary embeddings of `n_rot` values at `base`.
    pub fn plain(n_rot: usize, base: f32) -> Self {
        Self {
            n_rot,
            base,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            n_ctx_orig: 0,
            factors: Factors::None,
            mrope: None,
        }
    }

    /// YaRN's correction range of pairs (ggml_rope_yarn_corr_dims).
    fn corr_dims(&self) -> [f32; 2] {
        let n_dims = self.n_rot as f32;
        let dim = |beta: f32| {
            n_dims * (self.n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * self.base.ln())
        };
        let start = dim(self.beta_fast).floor();
        let end = dim(self.beta_slow).ceil();
        [start.max(0.0), end.min(n_dims - 1.0)]
    }

    /// cos and sin for each position: (positions, n_rot / 2) each, the magnitude included.
    /// `factors`: the frequency factors this embedding divides by (n_rot / 2 or more of them).
    pub fn angles(&self, positions: &[usize], factors: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
        let half = self.n_rot / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / self.base.powf((2 * i) as f32 / self.n_rot as f32))
            .collect();
        let corr = self.corr_dims();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for (i, f) in inv_freq.iter().enumerate() {
                let ff = factors.map_or(1.0, |f| f[i]);
                let p = match self.mrope {
                    Some(m) if m.still(i) => 0,
                    _ => p,
                };
                let extrap = p as f32 * f / ff;
                let interp = self.freq_scale * extrap;
                let (mut angle, mut mscale) = (interp, self.attn_factor);
                if self.ext_factor != 0.0 {
                    // ggml's ramp takes the pair index as an integer (i0 / 2).
                    let y = (i as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
                    let mix = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
                    angle = interp * (1.0 - mix) + extrap * mix;
                    mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
                }
                cos.push(angle.cos() * mscale);
                sin.push(angle.sin() * mscale);
            }
        }
        (cos, sin)
    }
}

/// llama.cpp's YaRN magnitude: 1 + 0.1·m·ln(s) for s > 1.
pub fn yarn_mscale(s: f32, m: f32) -> f32 {
    if s <= 1.0 {
        1.0
    } else {
        0.1 * m * s.ln() + 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_angles_are_position_times_frequency() {
        let cfg = RopeCfg::plain(8, 10_000.0);
        let (cos, sin) = cfg.angles(&[0, 3], None);
        assert_eq!(cos.len(), 8);
        assert_eq!(&cos[..4], &[1.0; 4]);
        assert_eq!(&sin[..4], &[0.0; 4]);
        for i in 0..4 {
            let theta = 3.0 * (1.0 / 10_000f32.powf((2 * i) as f32 / 8.0));
            assert_eq!(cos[4 + i], theta.cos());
            assert_eq!(sin[4 + i], theta.sin());
        }
    }

    #[test]
    fn factors_divide_and_linear_scaling_multiplies() {
        let mut cfg = RopeCfg::plain(4, 100.0);
        cfg.freq_scale = 0.25;
        let (cos, _) = cfg.angles(&[8], Some(&[2.0, 4.0]));
        let f1 = 1.0 / 100f32.powf(0.5);
        assert_eq!(cos[0], (0.25 * (8.0f32 / 2.0)).cos());
        assert_eq!(cos[1], (0.25 * (8.0 * f1 / 4.0)).cos());
    }

    #[test]
    fn text_mrope_leaves_the_pairs_of_the_fourth_section_still() {
        // Qwen3-VL's [24, 20, 20, 0] interleaved over 64 pairs: t takes every third pair from
        // 0 (up to 72, so all of them), h and w every third from 1 and 2 below 60; pairs 61
        // and 62 fall to the fourth section.
        let m = TextMrope {
            sections: [24, 20, 20, 0],
            interleaved: true,
        };
        let still: Vec<usize> = (0..64).filter(|&i| m.still(i)).collect();
        assert_eq!(still, [61, 62]);
        // Qwen2-VL's [16, 24, 24, 0] in runs covers every pair; [8, 8, 8, 8] leaves the last
        // run of each 32 still.
        let runs = |sections| TextMrope {
            sections,
            interleaved: false,
        };
        assert!((0..64).all(|i| !runs([16, 24, 24, 0]).still(i)));
        let still: Vec<usize> = (0..64).filter(|&i| runs([8, 8, 8, 8]).still(i)).collect();
        assert_eq!(still, (24..32).chain(56..64).collect::<Vec<_>>());
        let cfg = RopeCfg {
            mrope: Some(m),
            ..RopeCfg::plain(128, 10_000.0)
        };
        let (cos, sin) = cfg.angles(&[5], None);
        let (plain_cos, _) = RopeCfg::plain(128, 10_000.0).angles(&[5], None);
        assert_eq!((cos[61], sin[61], cos[62]), (1.0, 0.0, 1.0));
        assert_eq!(cos[60], plain_cos[60]);
        assert_eq!(cos[63], plain_cos[63]);
    }

    #[test]
    fn yarn_mixes_by_pair_and_scales_the_magnitude() {
        // Llama-style YaRN, factor 4 over an original 64 positions.
        let cfg = RopeCfg {
            freq_scale: 0.25,
            ext_factor: 1.0,
            n_ctx_orig: 64,
            ..RopeCfg::plain(64, 10_000.0)
        };
        let (cos, sin) = cfg.angles(&[100], None);
        let m = 1.0 + 0.1 * 4f32.ln();
        // Pair 0 turns fastest: fully extrapolated (the ramp is 1 below the range).
        assert!((cos[0] - 100f32.cos() * m).abs() < 1e-6);
        assert!((sin[0] - 100f32.sin() * m).abs() < 1e-6);
        // The last pair turns slowest: fully interpolated.
        let theta = 100.0 / 10_000f32.powf(62.0 / 64.0);
        assert!((cos[31] - (0.25 * theta).cos() * m).abs() < 1e-6);
        assert_eq!(yarn_mscale(4.0, 1.0), m);
    }
}
