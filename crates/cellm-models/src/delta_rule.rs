//! The gated delta rule (Gated DeltaNet), per value head: a `dk x dv` state `S` that decays by
//! `exp(g)` each token and is corrected towards `v` along `k` with rate `beta`:
//!
//! ```text
//! S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  out_t = S^T q_t
//! ```
//!
//! Tokens are processed in chunks (the UT-transform form of the DeltaNet paper): within a chunk
//! the corrections are found by one unit-lower-triangular solve, so a long prompt costs a few
//! small matrix products per chunk instead of a state read-modify-write per token. A single
//! decode token is a chunk of one.

/// Tokens per chunk (HF's and fla's choice).
pub const CHUNK: usize = 64;

/// One head's inputs for `n` tokens: `q`/`k` are `n x dk` (already L2-normalised and, for `q`,
/// scaled), `v` is `n x dv`, `g` (log decay) and `beta` have `n` entries.
pub struct HeadInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Runs the rule over all tokens of `x`, updating `state` (`dk x dv`, row-major) and writing
/// `n x dv` outputs.
pub fn run(x: &HeadInputs, dk: usize, dv: usize, state: &mut [f32], out: &mut [f32]) {
    let n = x.g.len();
    let mut start = 0;
    while start < n {
        let c = CHUNK.min(n - start);
        let part = HeadInputs {
            q: &x.q[start * dk..(start + c) * dk],
            k: &x.k[start * dk..(start + c) * dk],
            v: &x.v[start * dv..(start + c) * dv],
            g: &x.g[start..start + c],
            beta: &x.beta[start..start + c],
        };
        chunk(&part, dk, dv, state, &mut out[start * dv..(start + c) * dv]);
        start += c;
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `out (dv) = v (dk) ^T S (dk x dv)`.
fn read_state(vec: &[f32], state: &[f32], dv: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (a, row) in vec.iter().zip(state.chunks_exact(dv)) {
        out.iter_mut().zip(row).for_each(|(o, s)| *o += a * s);
    }
}

fn chunk(x: &HeadInputs, dk: usize, dv: usize, state: &mut [f32], out: &mut [f32]) {
    let c = x.g.len();
    // Cumulative log decay from the chunk start, inclusive.
    let mut cum = vec![0.0f32; c];
    let mut acc = 0.0;
    for (cu, g) in cum.iter_mut().zip(x.g) {
        acc += g;
        *cu = acc;
    }
    let decay = |i: usize, j: usize| (cum[i] - cum[j]).exp();
    let (k, q, v) = (
        |i: usize| &x.k[i * dk..(i + 1) * dk],
        |i: usize| &x.q[i * dk..(i + 1) * dk],
        |i: usize| &x.v[i * dv..(i + 1) * dv],
    );
    // Strictly lower L[i][j] = beta_i (k_i . k_j) exp(cum_i - cum_j); solve (I + L) U = beta V
    // and (I + L) W = beta K exp(cum) by forward substitution.
    let mut lower = vec![0.0f32; c * c];
    for i in 0..c {
        for j in 0..i {
            lower[i * c + j] = x.beta[i] * dot(k(i), k(j)) * decay(i, j);
        }
    }
    let mut u = vec![0.0f32; c * dv];
    let mut w = vec![0.0f32; c * dk];
    for i in 0..c {
        let (done_u, rest_u) = u.split_at_mut(i * dv);
        let ui = &mut rest_u[..dv];
        ui.iter_mut().zip(v(i)).for_each(|(o, a)| *o = x.beta[i] * a);
        let (done_w, rest_w) = w.split_at_mut(i * dk);
        let wi = &mut rest_w[..dk];
        let scale = x.beta[i] * cum[i].exp();
        wi.iter_mut().zip(k(i)).for_each(|(o, a)| *o = scale * a);
        for j in 0..i {
            let l = lower[i * c + j];
            ui.iter_mut().zip(&done_u[j * dv..(j + 1) * dv]).for_each(|(o, a)| *o -= l * a);
            wi.iter_mut().zip(&done_w[j * dk..(j + 1) * dk]).for_each(|(o, a)| *o -= l * a);
        }
    }
    // The corrections against the state at the chunk start: v_new = U - W S.
    let mut read = vec![0.0f32; dv];
    for i in 0..c {
        read_state(&w[i * dk..(i + 1) * dk], state, dv, &mut read);
        u[i * dv..(i + 1) * dv].iter_mut().zip(&read).for_each(|(o, r)| *o -= r);
    }
    let v_new = u;
    // Outputs: the decayed read of the old state plus the causal intra-chunk attention.
    let mut qd = vec![0.0f32; dk];
    for i in 0..c {
        let e = cum[i].exp();
        qd.iter_mut().zip(q(i)).for_each(|(o, a)| *o = e * a);
        let oi = &mut out[i * dv..(i + 1) * dv];
        read_state(&qd, state, dv, oi);
        for j in 0..=i {
            let a = dot(q(i), k(j)) * decay(i, j);
            oi.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]).for_each(|(o, b)| *o += a * b);
        }
    }
    // New state: S exp(cum_last) + sum_j exp(cum_last - cum_j) k_j v_new_j^T.
    let last = c - 1;
    let total = cum[last].exp();
    state.iter_mut().for_each(|s| *s *= total);
    for j in 0..c {
        let d = decay(last, j);
        for (kj, row) in k(j).iter().zip(state.chunks_exact_mut(dv)) {
            let a = d * kj;
            row.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]).for_each(|(s, b)| *s += a * b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The token-by-token recurrence, as the definition states it.
    fn recurrent(x: &HeadInputs, dk: usize, dv: usize, state: &mut [f32], out: &mut [f32]) {
        for t in 0..x.g.len() {
            state.iter_mut().for_each(|s| *s *= x.g[t].exp());
            let (k, q, v) = (&x.k[t * dk..][..dk], &x.q[t * dk..][..dk], &x.v[t * dv..][..dv]);
            let mut kv = vec![0.0; dv];
            read_state(k, state, dv, &mut kv);
            let delta: Vec<f32> = v.iter().zip(&kv).map(|(a, b)| x.beta[t] * (a - b)).collect();
            for (ki, row) in k.iter().zip(state.chunks_exact_mut(dv)) {
                row.iter_mut().zip(&delta).for_each(|(s, d)| *s += ki * d);
            }
            read_state(q, state, dv, &mut out[t * dv..(t + 1) * dv]);
        }
    }

    /// Chunks (a full one and a partial one, from a non-zero state) equal the recurrence.
    #[test]
    fn chunked_equals_recurrent() {
        let (n, dk, dv) = (CHUNK + 37, 8, 6);
        let val = |i: usize, m: usize| ((i * 7919 + m * 104_729) % 199) as f32 / 99.0 - 1.0;
        let unit = |rows: Vec<f32>, d: usize| -> Vec<f32> {
            rows.chunks(d)
                .flat_map(|r| {
                    let norm = r.iter().map(|a| a * a).sum::<f32>().sqrt();
                    r.iter().map(move |a| a / norm).collect::<Vec<_>>()
                })
                .collect()
        };
        let q = unit((0..n * dk).map(|i| val(i, 1)).collect(), dk);
        let k = unit((0..n * dk).map(|i| val(i, 2)).collect(), dk);
        let v: Vec<f32> = (0..n * dv).map(|i| val(i, 3)).collect();
        let g: Vec<f32> = (0..n).map(|i| -0.3 * (val(i, 4) + 1.0)).collect();
        let beta: Vec<f32> = (0..n).map(|i| 0.5 + 0.5 * val(i, 5)).collect();
        let x = HeadInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let start: Vec<f32> = (0..dk * dv).map(|i| 0.1 * val(i, 6)).collect();
        let (mut s1, mut s2) = (start.clone(), start);
        let (mut o1, mut o2) = (vec![0.0; n * dv], vec![0.0; n * dv]);
        run(&x, dk, dv, &mut s1, &mut o1);
        recurrent(&x, dk, dv, &mut s2, &mut o2);
        for (a, b) in o1.iter().zip(&o2).chain(s1.iter().zip(&s2)) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}
