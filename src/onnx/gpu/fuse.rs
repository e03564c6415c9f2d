//! Fusing chains of element-wise kernels into one `infer_fused` launch.
//!
//! A plan's unary and binary steps each read their inputs and write a whole intermediate
//! tensor. Where such a step's output is an intermediate that exactly one later
//! element-wise step reads, over the same index space and without broadcasting it, the
//! producer is folded into that consumer: one launch evaluates both per element, in
//! registers, and the intermediate is never written (a GELU exported as Div, Erf, Add,
//! Mul, Mul becomes one launch instead of five). Scalar constants become immediates of
//! the program instead of inputs.
//!
//! A fused program (kernels.cu, `infer_fused`): registers 0..3 hold inputs 0..3,
//! register 4 + j the result of instruction j; the output is the last result. a.p[0] is
//! the instruction count, a.p[1 + j] instruction j (bits 0-7 the op of `k_unary` or
//! `k_binary`, 8-9 the kind, 10-14 register a, 15-19 register b, 20-21 float slot).

use super::kargs::{KArgs, Kernel};
// Instruction kinds: unary; binary; binary with an immediate second operand (f[slot]);
// binary with an immediate first operand.
use super::ops::fused::{BINARY, BINARY_IMM_A, BINARY_IMM_B, UNARY};
use super::ops::unary;
use super::plan::step::{Buf, Ptr, Step};
use std::collections::HashMap;

/// Instructions per fused launch (p[1..16]).
pub const MAX_INSTRS: usize = 15;
const MAX_INPUTS: usize = 4;
const MAX_FLOATS: usize = 4;

/// Float parameters a unary op takes (a.f[0..n] of `infer_unary`).
fn unary_params(op: i64) -> usize {
    match op {
        unary::LEAKY_RELU | unary::ELU | unary::THRESHOLDED_RELU | unary::CELU | unary::SWISH => 1,
        unary::CLIP | unary::HARD_SIGMOID | unary::SELU | unary::SHRINK => 2,
        _ => 0,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Ins {
    kind: i64,
    op: i64,
    a: usize,
    b: usize,
    slot: usize,
}

impl Ins {
    fn encode(&self) -> i64 {
        (self.op & 0xff)
            | (self.kind & 3) << 8
            | (self.a as i64 & 31) << 10
            | (self.b as i64 & 31) << 15
            | (self.slot as i64 & 3) << 20
    }
}

/// An element-wise step as a program.
#[derive(Clone)]
struct Prog {
    rank: usize,
    dims: [i64; 8],
    ft: i64,
    ins: Vec<(Ptr, [i64; 8], i64)>,
    code: Vec<Ins>,
    floats: Vec<f32>,
    out: Ptr,
    ostrides: [i64; 8],
    ooff: i64,
}

fn same_buf(a: &Buf, b: &Buf) -> bool {
    match (a, b) {
        (Buf::Input(x), Buf::Input(y)) | (Buf::Output(x), Buf::Output(y)) => x == y,
        (Buf::Temp(x), Buf::Temp(y)) => x == y,
        (Buf::Const(x), Buf::Const(y)) => std::sync::Arc::ptr_eq(x, y),
        _ => false,
    }
}

fn same_ptr(a: &Ptr, b: &Ptr) -> bool {
    a.bytes == b.bytes && same_buf(&a.buf, &b.buf)
}

fn contiguous(dims: &[i64]) -> Vec<i64> {
    super::host::strides(dims)
}

impl Prog {
    /// The program of a unary or binary step (None for other steps).
    fn of(step: &Step, scalars: &HashMap<usize, f32>) -> Option<Prog> {
        let Step::Kernel { k, args, ins, out } = step else {
            return None;
        };
        let a = &**args;
        let nin = match k {
            Kernel::Unary => 1,
            Kernel::Binary => 2,
            _ => return None,
        };
        let rank = usize::try_from(a.rank).ok().filter(|&r| r <= 8)?;
        let mut p = Prog {
            rank,
            dims: a.dims,
            ft: a.ft,
            ins: Vec::new(),
            code: Vec::new(),
            floats: Vec::new(),
            out: out.clone(),
            ostrides: a.ostrides,
            ooff: a.ooff,
        };
        let mut regs = [0usize; 2];
        let mut imm: [Option<f32>; 2] = [None, None];
        for i in 0..nin {
            let ptr = ins[i].clone()?;
            let broadcast_scalar = a.strides[i][..rank].iter().all(|&s| s == 0);
            if let (Buf::Const(m), true) = (&ptr.buf, broadcast_scalar && ptr.bytes == 0) {
                if let Some(v) = scalars.get(&(std::sync::Arc::as_ptr(m) as usize)) {
                    if *k == Kernel::Binary {
                        imm[i] = Some(*v);
                        continue;
                    }
                }
            }
            regs[i] = p.input(ptr, a.strides[i], a.off[i])?;
        }
        let op = a.p[0];
        let ins = match (*k, imm) {
            (Kernel::Unary, _) => {
                let slot = p.floats.len();
                p.floats
                    .extend_from_slice(&a.f[..unary_params(op).min(MAX_FLOATS)]);
                Ins {
                    kind: UNARY,
                    op,
                    a: regs[0],
                    b: 0,
                    slot,
                }
            }
            (_, [None, None]) => Ins {
                kind: BINARY,
                op,
                a: regs[0],
                b: regs[1],
                slot: 0,
            },
            (_, [None, Some(v)]) => {
                p.floats.push(v);
                Ins {
                    kind: BINARY_IMM_B,
                    op,
                    a: regs[0],
                    b: 0,
                    slot: p.floats.len() - 1,
                }
            }
            (_, [Some(v), None]) => {
                p.floats.push(v);
                Ins {
                    kind: BINARY_IMM_A,
                    op,
                    a: regs[1],
                    b: 0,
                    slot: p.floats.len() - 1,
                }
            }
            // Both constant: evaluated on the host while planning; keep the kernel.
            (_, [Some(_), Some(_)]) => return None,
        };
        p.code.push(ins);
        Some(p)
    }

    /// The register of an input (added if new).
    fn input(&mut self, ptr: Ptr, strides: [i64; 8], off: i64) -> Option<usize> {
        if let Some(i) = self
            .ins
            .iter()
            .position(|(p, s, o)| same_ptr(p, &ptr) && *s == strides && *o == off)
        {
            return Some(i);
        }
        if self.ins.len() >= MAX_INPUTS {
            return None;
        }
        self.ins.push((ptr, strides, off));
        Some(self.ins.len() - 1)
    }

    fn result(&self) -> usize {
        MAX_INPUTS + self.code.len() - 1
    }

    /// The temp this program writes contiguously over its own index space.
    fn writes_temp(&self) -> Option<usize> {
        let dims = &self.dims[..self.rank];
        match self.out.buf {
            Buf::Temp(t)
                if self.out.bytes == 0
                    && self.ooff == 0
                    && self.ostrides[..self.rank] == contiguous(dims)[..] =>
            {
                Some(t)
            }
            _ => None,
        }
    }

    /// This program with `producer` evaluated in place of its reads of `temp`, or None
    /// when the result would not fit one launch.
    fn absorb(&self, producer: &Prog, temp: usize) -> Option<Prog> {
        let mut p = Prog {
            ins: Vec::new(),
            code: Vec::new(),
            floats: Vec::new(),
            ..self.clone()
        };
        if producer.code.len() + self.code.len() > MAX_INSTRS
            || producer.floats.len() + self.floats.len() > MAX_FLOATS
        {
            return None;
        }
        // The producer's inputs, then the consumer's other ones.
        let mut map_p = [0usize; MAX_INPUTS];
        for (i, (ptr, s, o)) in producer.ins.iter().enumerate() {
            map_p[i] = p.input(ptr.clone(), *s, *o)?;
        }
        let mut map_c = [usize::MAX; MAX_INPUTS];
        for (i, (ptr, s, o)) in self.ins.iter().enumerate() {
            if !matches!(ptr.buf, Buf::Temp(t) if t == temp) {
                map_c[i] = p.input(ptr.clone(), *s, *o)?;
            }
        }
        p.floats.extend_from_slice(&producer.floats);
        let reg_p = |r: usize| {
            if r < MAX_INPUTS {
                map_p[r]
            } else {
                r
            }
        };
        for ins in &producer.code {
            p.code.push(Ins {
                a: reg_p(ins.a),
                b: reg_p(ins.b),
                ..*ins
            });
        }
        let produced = producer.result();
        let shift = producer.code.len();
        let fshift = producer.floats.len();
        p.floats.extend_from_slice(&self.floats);
        let reg_c = |r: usize| {
            if r < MAX_INPUTS {
                if map_c[r] == usize::MAX {
                    produced
                } else {
                    map_c[r]
                }
            } else {
                r + shift
            }
        };
        for ins in &self.code {
            let uses_b = ins.kind == BINARY;
            p.code.push(Ins {
                a: reg_c(ins.a),
                b: if uses_b { reg_c(ins.b) } else { ins.b },
                slot: if ins.kind == BINARY {
                    0
                } else {
                    ins.slot + fshift
                },
                ..*ins
            });
        }
        Some(p)
    }

    fn step(&self) -> Step {
        let mut a = KArgs {
            n: self.dims[..self.rank].iter().product(),
            rank: self.rank as i64,
            dims: self.dims,
            ostrides: self.ostrides,
            ooff: self.ooff,
            ft: self.ft,
            ..KArgs::default()
        };
        let mut ins: [Option<Ptr>; 4] = [None, None, None, None];
        for (i, (ptr, s, o)) in self.ins.iter().enumerate() {
            a.strides[i] = *s;
            a.off[i] = *o;
            ins[i] = Some(ptr.clone());
        }
        a.p[0] = self.code.len() as i64;
        for (j, ins) in self.code.iter().enumerate() {
            a.p[1 + j] = ins.encode();
        }
        a.f[..self.floats.len()].copy_from_slice(&self.floats);
        Step::Kernel {
            k: Kernel::Fused,
            args: Box::new(a),
            ins,
            out: self.out.clone(),
        }
    }
}

/// How a step touches temps: (read, written).
fn temps_of(step: &Step) -> (Vec<usize>, Vec<usize>) {
    let t = |p: &Ptr| match p.buf {
        Buf::Temp(t) => Some(t),
        _ => None,
    };
    match step {
        Step::Kernel { ins, out, .. } => (
            ins.iter().flatten().filter_map(t).collect(),
            t(out).into_iter().collect(),
        ),
        // A GEMM with beta reads C too.
        Step::Gemm { a, b, c, .. } => (
            [a, b, c].into_iter().filter_map(t).collect(),
            t(c).into_iter().collect(),
        ),
        Step::Copy { dst, src, .. } => (t(src).into_iter().collect(), t(dst).into_iter().collect()),
    }
}

/// Fuses element-wise chains in `steps` (see the module's comment). `scalars` maps the
/// device address of a one-element constant to its value (already in the type it is
/// computed in). Steps that absorbed nothing stay as they are; temps that no step uses
/// any more are left for the caller to drop from the arena.
pub fn fuse(steps: Vec<Step>, scalars: &HashMap<usize, f32>) -> Vec<Step> {
    // Reads and writes of each temp over the whole plan.
    let mut reads: HashMap<usize, usize> = HashMap::new();
    let mut writes: HashMap<usize, usize> = HashMap::new();
    for s in &steps {
        let (r, w) = temps_of(s);
        for t in r {
            *reads.entry(t).or_default() += 1;
        }
        for t in w {
            *writes.entry(t).or_default() += 1;
        }
    }
    let mut progs: Vec<Option<Prog>> = steps.iter().map(|s| Prog::of(s, scalars)).collect();
    let mut fused = vec![false; steps.len()];
    // Where each fusable temp was written (by a program).
    let mut writer: HashMap<usize, usize> = HashMap::new();
    let mut removed = vec![false; steps.len()];
    for j in 0..steps.len() {
        let Some(mut consumer) = progs[j].clone() else {
            continue;
        };
        loop {
            let dims = consumer.dims[..consumer.rank].to_vec();
            let cont = contiguous(&dims);
            // A temp read once, by this program only, contiguously over the same
            // index space, written once by an earlier program of the same type.
            let candidate = consumer.ins.iter().find_map(|(ptr, s, o)| {
                let Buf::Temp(t) = ptr.buf else { return None };
                let i = *writer.get(&t)?;
                let p = progs[i].as_ref()?;
                let ok = ptr.bytes == 0
                    && *o == 0
                    && s[..consumer.rank] == cont[..]
                    && reads.get(&t) == Some(&1)
                    && writes.get(&t) == Some(&1)
                    && p.rank == consumer.rank
                    && p.dims[..p.rank] == dims[..]
                    && p.ft == consumer.ft
                    && consumer
                        .ins
                        .iter()
                        .filter(|(q, ..)| matches!(q.buf, Buf::Temp(u) if u == t))
                        .count()
                        == 1;
                ok.then_some((t, i))
            });
            let Some((t, i)) = candidate else { break };
            let Some(merged) = progs[i].as_ref().and_then(|p| consumer.absorb(p, t)) else {
                break;
            };
            consumer = merged;
            removed[i] = true;
            fused[j] = true;
            writer.remove(&t);
        }
        if let Some(t) = consumer.writes_temp() {
            writer.insert(t, j);
        }
        progs[j] = Some(consumer);
    }
    steps
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !removed[*i])
        .map(|(i, s)| match (&progs[i], fused[i]) {
            (Some(p), true) => p.step(),
            _ => s,
        })
        .collect()
}

/// Merges adjacent dims of strided launches (element-wise, copies, Where, comparisons,
/// integer arithmetic, fused programs) wherever every operand is laid out contiguously across them, and drops
/// dims of size 1, so that each element's index is split over as few dims as possible
/// (a same-shape element-wise launch becomes 1-D; a bias broadcast over rows 2-D). The
/// elements each launch touches are unchanged.
pub fn collapse_dims(steps: &mut [Step]) {
    for step in steps {
        let Step::Kernel { k, args, ins, .. } = step else {
            continue;
        };
        if !matches!(
            k,
            Kernel::Unary
                | Kernel::Binary
                | Kernel::StridedCopy
                | Kernel::Where
                | Kernel::Compare
                | Kernel::Fused
                | Kernel::Int
        ) {
            continue;
        }
        let nin = ins.iter().take_while(|p| p.is_some()).count();
        collapse(args, nin);
    }
}

/// See [`collapse_dims`]; `nin` inputs use strides[0..nin].
fn collapse(a: &mut KArgs, nin: usize) {
    let Ok(rank) = usize::try_from(a.rank) else {
        return;
    };
    if rank > 8 {
        return;
    }
    // (dim, stride of each input, output stride), innermost first.
    let mut merged: Vec<(i64, [i64; 4], i64)> = Vec::with_capacity(rank);
    for d in (0..rank).rev() {
        let dim = a.dims[d];
        if dim == 1 {
            continue;
        }
        let mut s = [0i64; 4];
        for (k, v) in s.iter_mut().enumerate().take(nin) {
            *v = a.strides[k][d];
        }
        let os = a.ostrides[d];
        if let Some(inner) = merged.last_mut() {
            let fits = (0..nin).all(|k| s[k] == inner.1[k] * inner.0) && os == inner.2 * inner.0;
            if fits {
                inner.0 *= dim;
                continue;
            }
        }
        merged.push((dim, s, os));
    }
    merged.reverse();
    a.rank = merged.len() as i64;
    a.dims = [0; 8];
    a.ostrides = [0; 8];
    for k in 0..nin {
        a.strides[k] = [0; 8];
    }
    for (d, (dim, s, os)) in merged.iter().enumerate() {
        a.dims[d] = *dim;
        a.ostrides[d] = *os;
        for (row, v) in a.strides.iter_mut().zip(s).take(nin) {
            row[d] = *v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(dims: &[i64], ins: &[&[i64]], ostrides: &[i64]) -> KArgs {
        let mut a = KArgs {
            rank: dims.len() as i64,
            n: dims.iter().product(),
            ..KArgs::default()
        };
        a.dims[..dims.len()].copy_from_slice(dims);
        for (k, s) in ins.iter().enumerate() {
            a.strides[k][..s.len()].copy_from_slice(s);
        }
        a.ostrides[..ostrides.len()].copy_from_slice(ostrides);
        a
    }

    /// Every element's offsets (inputs, output) over the index space, in order.
    fn offsets(a: &KArgs, nin: usize) -> Vec<(Vec<i64>, i64)> {
        let rank = a.rank as usize;
        (0..a.n)
            .map(|i| {
                let mut rem = i;
                let (mut o, mut oo) = (vec![0i64; nin], 0i64);
                for d in (0..rank).rev() {
                    let x = rem % a.dims[d];
                    rem /= a.dims[d];
                    oo += x * a.ostrides[d];
                    for (k, v) in o.iter_mut().enumerate() {
                        *v += x * a.strides[k][d];
                    }
                }
                (o, oo)
            })
            .collect()
    }

    #[test]
    fn collapsing_keeps_every_offset() {
        type Case = (Vec<i64>, Vec<Vec<i64>>, Vec<i64>, i64);
        let cases: Vec<Case> = vec![
            // Same shape, contiguous: one dim.
            (
                vec![2, 3, 4],
                vec![vec![12, 4, 1], vec![12, 4, 1]],
                vec![12, 4, 1],
                1,
            ),
            // A bias over the last dim: rows and columns.
            (
                vec![2, 3, 4],
                vec![vec![12, 4, 1], vec![0, 0, 1]],
                vec![12, 4, 1],
                2,
            ),
            // A transposed read: nothing merges.
            (vec![3, 4], vec![vec![1, 3]], vec![4, 1], 2),
            // Size-1 dims go; a per-channel broadcast keeps three dims.
            (
                vec![2, 1, 3, 5],
                vec![vec![15, 15, 5, 1], vec![0, 0, 1, 0]],
                vec![15, 15, 5, 1],
                3,
            ),
            // All ones: a scalar.
            (vec![1, 1], vec![vec![1, 1]], vec![1, 1], 0),
        ];
        for (dims, ins, os, want_rank) in cases {
            let refs: Vec<&[i64]> = ins.iter().map(|v| v.as_slice()).collect();
            let a = args(&dims, &refs, &os);
            let mut b = a;
            collapse(&mut b, ins.len());
            assert_eq!(b.rank, want_rank, "{dims:?} {ins:?}");
            assert_eq!(b.dims[..b.rank as usize].iter().product::<i64>(), a.n);
            assert_eq!(
                offsets(&a, ins.len()),
                offsets(&b, ins.len()),
                "{dims:?} {ins:?}"
            );
        }
    }
}
