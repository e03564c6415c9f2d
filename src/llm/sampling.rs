//! Picking the next token from a row of logits: penalties and biases first, then greedy,
//! or temperature / top-k / min-p / top-p sampling from a small seeded PRNG.
//!
//! Reproducibility rule: a sampled token takes exactly one number from the sequence's
//! [`Rng`] and a greedy one takes none, so a request's tokens depend only on its logits,
//! its parameters and its seed — never on how requests were batched.

use std::cmp::Ordering;

/// How to pick a token. Greedy (argmax, lowest index on ties) when `temperature <= 0`
/// (or NaN) or `top_k == 1`; `top_k` 0 = off; `min_p` 0 = off; `top_p` >= 1 = off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    /// Drops tokens less likely than `min_p` times the most likely one (after temperature
    /// and top-k, before top-p).
    pub min_p: f32,
}

impl SamplingParams {
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };

    pub fn is_greedy(&self) -> bool {
        // NaN counts as greedy: `> 0.0` is false for it.
        self.temperature.partial_cmp(&0.0) != Some(Ordering::Greater) || self.top_k == 1
    }
}

/// Plain sampling from the model's distribution (temperature 1, no truncation).
impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }
}

/// Penalties on tokens already seen, as vLLM and the OpenAI API define them:
/// `repetition` (> 0, 1 = off) divides a positive logit and multiplies a negative one for
/// every token in the prompt or the output; `presence` is subtracted once from every token
/// in the output, `frequency` once per time it occurs there (0 = off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalties {
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
}

impl Penalties {
    pub const NONE: Penalties = Penalties {
        repetition: 1.0,
        presence: 0.0,
        frequency: 0.0,
    };

    pub fn is_none(&self) -> bool {
        *self == Penalties::NONE
    }
}

/// Applies `p` to `logits`: `prompt` holds the prompt's distinct tokens (sorted), `counts`
/// each output token with the times it occurs. Tokens outside `logits` are ignored.
pub fn penalize(
    logits: &mut [f32],
    p: &Penalties,
    prompt: &[u32],
    counts: &std::collections::HashMap<u32, u32>,
) {
    let repeat = |l: f32| {
        if l > 0.0 {
            l / p.repetition
        } else {
            l * p.repetition
        }
    };
    if p.repetition != 1.0 {
        for &t in prompt {
            if !counts.contains_key(&t) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = repeat(*l);
                }
            }
        }
    }
    for (&t, &c) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            if p.repetition != 1.0 {
                *l = repeat(*l);
            }
            *l -= p.frequency * c as f32 + p.presence;
        }
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, and the same on every platform.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks a token from `logits` (one vocabulary row). Returns the token and its log-prob
/// under the distribution actually sampled from (tempered, then top-k, then top-p
/// truncated and renormalised); greedy picks return 0.0, the log-prob of a point mass.
/// `scratch` is reused between calls to avoid allocating.
pub fn sample(
    logits: &[f32],
    p: &SamplingParams,
    rng: &mut Rng,
    scratch: &mut Vec<(f32, u32)>,
) -> (u32, f32) {
    if logits.is_empty() {
        return (0, 0.0);
    }
    if p.is_greedy() {
        return (argmax(logits), 0.0);
    }
    let u = rng.next_f64();
    let inv_t = 1.0 / p.temperature as f64;
    let max = logits[argmax(logits) as usize] as f64;
    // Weights relative to the largest logit, so the largest is exactly 1.
    scratch.clear();
    scratch.extend(
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| ((((l as f64 - max) * inv_t).exp()) as f32, i as u32)),
    );
    let v = scratch.len();
    let k = match p.top_k as usize {
        0 => v,
        k => k.min(v),
    };
    if k < v {
        scratch.select_nth_unstable_by(k - 1, by_weight_desc);
        scratch.truncate(k);
    }
    if p.min_p > 0.0 {
        // Weights are relative to the most likely token (exactly 1), which stays.
        scratch.retain(|&(w, _)| w >= p.min_p);
    }
    if p.top_p < 1.0 {
        let kept = nucleus(scratch, p.top_p);
        scratch.truncate(kept);
    }
    // The candidates in the order they are walked; sorted when truncated (the nucleus
    // sorted them already), vocabulary order otherwise: either way fixed by the logits.
    if k < v && p.top_p >= 1.0 {
        scratch.sort_unstable_by(by_weight_desc);
    }
    let total: f64 = scratch.iter().map(|&(w, _)| w as f64).sum();
    let target = u * total;
    let mut acc = 0.0f64;
    let mut chosen = scratch[scratch.len() - 1];
    for &(w, i) in scratch.iter() {
        acc += w as f64;
        if acc > target {
            chosen = (w, i);
            break;
        }
    }
    let logp = ((chosen.0 as f64) / total).ln();
    (chosen.1, logp as f32)
}

/// Index of the largest logit, the lowest one on ties; NaNs are never chosen unless
/// everything is NaN.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() && !l.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Larger weight first, lower token id on ties: a total order, so unstable sorts and
/// selections give one answer.
fn by_weight_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Sorts the leading candidates of `c` (largest weight first) far enough to find the
/// smallest prefix holding at least `top_p` of the mass, and returns its length (>= 1).
fn nucleus(c: &mut [(f32, u32)], top_p: f32) -> usize {
    let total: f64 = c.iter().map(|&(w, _)| w as f64).sum();
    let need = top_p.max(0.0) as f64 * total;
    // Usually a few dozen tokens hold the mass: sort a growing head instead of it all.
    let mut m = 64.min(c.len());
    loop {
        if m < c.len() {
            c.select_nth_unstable_by(m - 1, by_weight_desc);
        }
        c[..m].sort_unstable_by(by_weight_desc);
        let mut acc = 0.0f64;
        for (i, &(w, _)) in c[..m].iter().enumerate() {
            acc += w as f64;
            if acc >= need {
                return i + 1;
            }
        }
        if m == c.len() {
            return m;
        }
        m = (m * 4).min(c.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
        }
    }

    #[test]
    fn min_p_drops_tokens_below_a_share_of_the_best() {
        // Probabilities 0.5, 0.25, 0.15, 0.1: min_p 0.25 keeps those >= 0.125.
        let logits: Vec<f32> = [0.5f32, 0.25, 0.15, 0.1].iter().map(|p| p.ln()).collect();
        let p = SamplingParams {
            min_p: 0.25,
            ..params(1.0, 0, 1.0)
        };
        let h = histogram(&logits, &p, 20_000, 12);
        assert!(h[0] > 0 && h[1] > 0 && h[2] > 0 && h[3] == 0, "{h:?}");
        // Renormalised over the kept three: 0.5 / 0.9.
        let share = h[0] as f64 / 20_000.0;
        assert!((share - 0.5 / 0.9).abs() < 0.015, "{share}");
        // Temperature first: at 0.5 the weights are squared (1, 0.25, 0.09, 0.04), and
        // min_p 0.2 keeps two.
        let p = SamplingParams {
            min_p: 0.2,
            ..params(0.5, 0, 1.0)
        };
        let h = histogram(&logits, &p, 5_000, 13);
        assert!(h[2] == 0 && h[1] > 0, "{h:?}");
        // min_p 1 keeps only the best.
        let p = SamplingParams {
            min_p: 1.0,
            ..params(1.0, 0, 1.0)
        };
        assert_eq!(histogram(&logits, &p, 500, 14)[0], 500);
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let mut counts = std::collections::HashMap::new();
        counts.insert(1u32, 3u32);
        counts.insert(2, 1);
        counts.insert(99, 1); // outside the vocabulary: ignored
        let p = Penalties {
            repetition: 2.0,
            presence: 0.5,
            frequency: 0.25,
        };
        let mut l = vec![4.0f32, 4.0, -4.0, 4.0, 1.0];
        penalize(&mut l, &p, &[0, 1, 4], &counts);
        // 0: prompt only -> 4/2; 1: output x3 (and prompt, once) -> 4/2 - 0.75 - 0.5;
        // 2: output x1, negative -> -4*2 - 0.25 - 0.5; 3: unseen; 4: prompt -> 1/2.
        assert_eq!(l, vec![2.0, 0.75, -8.75, 4.0, 0.5]);
        let mut l = vec![1.0f32; 5];
        penalize(&mut l, &Penalties::NONE, &[0, 1], &counts);
        assert_eq!(l, vec![1.0; 5]);
        assert!(Penalties::NONE.is_none() && !p.is_none());
    }

    /// Draw counts per token over `n` samples.
    fn histogram(logits: &[f32], p: &SamplingParams, n: usize, seed: u64) -> Vec<usize> {
        let mut rng = Rng::new(seed);
        let mut scratch = Vec::new();
        let mut h = vec![0; logits.len()];
        for _ in 0..n {
            h[sample(logits, p, &mut rng, &mut scratch).0 as usize] += 1;
        }
        h
    }

    #[test]
    fn rng_is_deterministic_and_uniform() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(7);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        assert_ne!(a[0], Rng::new(8).next_u64());
        let mut r = Rng::new(1);
        let mean = (0..100_000).map(|_| r.next_f64()).sum::<f64>() / 100_000.0;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
    }

    #[test]
    fn greedy_takes_the_lowest_index_on_ties_and_no_randomness() {
        let logits = [1.0, 3.0, -2.0, 3.0, 0.5];
        let mut scratch = Vec::new();
        for p in [
            params(0.0, 0, 1.0),
            params(-1.0, 50, 0.5),
            params(0.7, 1, 1.0),
            params(f32::NAN, 0, 1.0),
        ] {
            let mut rng = Rng::new(3);
            assert_eq!(sample(&logits, &p, &mut rng, &mut scratch), (1, 0.0));
            // No number was drawn.
            assert_eq!(rng.next_u64(), Rng::new(3).next_u64());
        }
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 2);
    }

    #[test]
    fn one_draw_per_sampled_token() {
        let logits = [0.1, 0.2, 0.3, 0.4];
        let mut scratch = Vec::new();
        for p in [
            params(1.0, 0, 1.0),
            params(0.5, 2, 1.0),
            params(1.0, 0, 0.01),
            params(2.0, 3, 0.9),
        ] {
            let mut rng = Rng::new(11);
            sample(&logits, &p, &mut rng, &mut scratch);
            let mut fresh = Rng::new(11);
            fresh.next_u64();
            assert_eq!(rng.next_u64(), fresh.next_u64(), "{p:?}");
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 101) as f32 / 10.0)
            .collect();
        let p = params(0.8, 40, 0.9);
        let run = |seed| {
            let mut rng = Rng::new(seed);
            let mut scratch = Vec::new();
            (0..50)
                .map(|_| sample(&logits, &p, &mut rng, &mut scratch))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn temperature_one_follows_the_softmax() {
        let logits = [0.0, (2.0f32).ln(), (5.0f32).ln()]; // probabilities 1/8, 2/8, 5/8
        let n = 80_000;
        let h = histogram(&logits, &params(1.0, 0, 1.0), n, 1);
        for (i, want) in [0.125, 0.25, 0.625].iter().enumerate() {
            let got = h[i] as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
        }
        // The log-prob is the softmax's.
        let mut scratch = Vec::new();
        let (t, lp) = sample(
            &logits,
            &params(1.0, 0, 1.0),
            &mut Rng::new(9),
            &mut scratch,
        );
        let want = [0.125f32, 0.25, 0.625][t as usize].ln();
        assert!((lp - want).abs() < 1e-6, "{lp} vs {want}");
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let logits = [0.0, 1.0];
        let n = 40_000;
        let cold = histogram(&logits, &params(0.25, 0, 1.0), n, 2)[1] as f64 / n as f64;
        let warm = histogram(&logits, &params(4.0, 0, 1.0), n, 2)[1] as f64 / n as f64;
        let p = |t: f64| 1.0 / (1.0 + (-1.0 / t).exp());
        assert!((cold - p(0.25)).abs() < 0.01, "{cold}");
        assert!((warm - p(4.0)).abs() < 0.01, "{warm}");
    }

    #[test]
    fn top_k_keeps_the_k_best_lowest_index_on_ties() {
        let logits = [1.0, 5.0, 2.0, 5.0, 4.0, 5.0];
        let h = histogram(&logits, &params(1.0, 2, 1.0), 5_000, 3);
        assert!(h[1] > 0 && h[3] > 0);
        assert_eq!(h.iter().sum::<usize>(), h[1] + h[3]);
        let h = histogram(&logits, &params(1.0, 4, 1.0), 5_000, 3);
        assert!(h[4] > 0 && h[0] == 0 && h[2] == 0);
        // top_k larger than the vocabulary is off.
        let h = histogram(&logits, &params(100.0, 99, 1.0), 5_000, 3);
        assert!(h.iter().all(|&c| c > 0), "{h:?}");
        // The log-prob is under the truncated distribution: two equal candidates.
        let mut scratch = Vec::new();
        let (_, lp) = sample(
            &logits,
            &params(1.0, 2, 1.0),
            &mut Rng::new(1),
            &mut scratch,
        );
        assert!((lp - 0.5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_the_smallest_head_with_enough_mass() {
        // Probabilities 0.5, 0.25, 0.125, 0.125.
        let logits: Vec<f32> = [4.0f32, 2.0, 1.0, 1.0].iter().map(|p| p.ln()).collect();
        let kept = |top_p| {
            let h = histogram(&logits, &params(1.0, 0, top_p), 4_000, 4);
            h.iter().filter(|&&c| c > 0).count()
        };
        assert_eq!(kept(0.4), 1);
        assert_eq!(kept(0.6), 2);
        assert_eq!(kept(0.8), 3);
        assert_eq!(kept(0.99), 4);
        assert_eq!(kept(0.0), 1);
        // Within the nucleus, the renormalised proportions hold: 2:1.
        let h = histogram(&logits, &params(1.0, 0, 0.7), 30_000, 5);
        let ratio = h[0] as f64 / h[1] as f64;
        assert!((ratio - 2.0).abs() < 0.1, "{ratio}");
        // Ties at the edge: the lower token id is in, the other out (0.5+0.25+0.125).
        let h = histogram(&logits, &params(1.0, 0, 0.8), 4_000, 6);
        assert!(h[2] > 0 && h[3] == 0);
    }

    #[test]
    fn top_p_over_a_large_vocabulary() {
        // A flat tail wider than the first sorted head (64): the nucleus must grow.
        let mut logits = vec![0.0f32; 5000];
        logits[17] = 3.0;
        let h = histogram(&logits, &params(1.0, 0, 0.5), 2_000, 7);
        let distinct = h.iter().filter(|&&c| c > 0).count();
        assert!(distinct > 64, "{distinct}");
        assert!(h[17] > 0);
        // top-k then top-p: the nucleus is taken within the k best.
        let h = histogram(&logits, &params(1.0, 10, 0.99), 2_000, 8);
        assert_eq!(h.iter().filter(|&&c| c > 0).count(), 10);
    }
}
