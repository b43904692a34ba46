//! A mixture-of-experts layer's experts on gen's CPU kernels, on host slices: each chosen
//! expert's gate/up product over the rows of the tokens that chose it, the gated activation,
//! the down product, each followed by its scale, with no tensor between them (a decode step
//! runs two or three products for each of eight experts a layer, where tensor operations'
//! fixed costs would outweigh the products). The same kernels, and bits, as the tensor path.

use rayon::prelude::*;

use super::matmul::CpuQWeight;
use super::ops::{gated_mul_slices, swiglu_oai_slices};
use crate::model::config::Activation;
use crate::model::qlinear::{Projections, QLinear};
use crate::model::weights::{Affine, Mlp};

/// An expert's matrices on gen's kernels: gate/up (one fused matrix and its part widths, or
/// separate ones) and down; None where one is not, or a bias comes before a scale.
fn on_kernels(m: &Mlp) -> Option<(Vec<(&CpuQWeight, Vec<usize>)>, &CpuQWeight)> {
    let ins = match &m.gate_up {
        Projections::Fused { linear, widths } => vec![(cpu(linear)?, widths.clone())],
        Projections::Separate(ls) => ls
            .iter()
            .map(|l| cpu(l).map(|w| (w, vec![w.dims().0])))
            .collect::<Option<Vec<_>>>()?,
    };
    let scale_then_bias = |a: &Affine| a.bias.is_none() || !a.bias_first || a.scale.is_none();
    if !m.gate_up_post.iter().all(scale_then_bias) || !scale_then_bias(&m.down_post) {
        return None;
    }
    Some((ins, cpu(&m.w_down)?))
}

fn cpu(l: &QLinear) -> Option<&CpuQWeight> {
    match l {
        QLinear::Cpu(w) => Some(w),
        _ => None,
    }
}

/// Whether [`run`] takes this expert with this activation.
pub fn runs(m: &Mlp, act: Activation) -> bool {
    let gated = m.gate_up_post.len() == 2;
    let act_ok = match act {
        Activation::Silu | Activation::GeluTanh => true,
        Activation::SwigluOai => gated,
        Activation::ReluSquared => false,
    };
    act_ok && on_kernels(m).is_some()
}

/// The expert over `t` rows of `x` (t × d): t rows of d. Call only where [`runs`] says so.
pub fn run(m: &Mlp, x: &[f32], t: usize, act: Activation) -> Vec<f32> {
    let (ins, down) = on_kernels(m).expect("checked by runs");
    let mut parts: Vec<Vec<f32>> = ins
        .iter()
        .flat_map(|(w, widths)| w.matmul_parts(x, t, widths))
        .collect();
    for (p, post) in parts.iter_mut().zip(&m.gate_up_post) {
        affine(p, post);
    }
    let a = match parts.len() {
        2 if act == Activation::SwigluOai => swiglu_oai_slices(&parts[0], &parts[1]),
        2 => gated_mul_slices(&parts[0], &parts[1], act == Activation::GeluTanh),
        _ => {
            let u = &parts[0];
            let ones = vec![1f32; u.len()];
            gated_mul_slices(u, &ones, act == Activation::GeluTanh)
        }
    };
    let mut y = down.matmul(&a, t);
    affine(&mut y, &m.down_post);
    y
}

/// Rows of a product through its scale, then its bias (one value per column), as
/// [`Affine::apply`] does where no bias comes first.
fn affine(v: &mut [f32], a: &Affine) {
    if let Some(s) = a.scale {
        for x in v.iter_mut() {
            *x *= s;
        }
    }
    if let Some(b) = &a.bias {
        let b: Vec<f32> = b
            .to_dtype(candle_core::DType::F32)
            .and_then(|b| b.to_vec1())
            .expect("a bias of f32 values on the host");
        for row in v.chunks_exact_mut(b.len()) {
            for (x, b) in row.iter_mut().zip(&b) {
                *x += b;
            }
        }
    }
}

/// Every chosen expert at once: `work` holds (expert, the tokens that chose it), `xs` the
/// pass's rows of `d`. The experts run side by side on the thread pool (a decode step's eight
/// experts are eight small products each, which alone would each be a parallel region of
/// their own); each one's rows are the same bits as [`run`] alone gives.
pub fn run_all(
    experts: &[Mlp],
    work: &[(usize, Vec<u32>)],
    xs: &[f32],
    d: usize,
    act: Activation,
) -> Vec<Vec<f32>> {
    work.par_iter()
        .map(|(e, tokens)| {
            let mut xe = Vec::with_capacity(tokens.len() * d);
            for &t in tokens {
                xe.extend_from_slice(&xs[t as usize * d..(t as usize + 1) * d]);
            }
            run(&experts[*e], &xe, tokens.len(), act)
        })
        .collect()
}
