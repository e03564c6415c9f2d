//! Element-wise operators: the unary and binary float operations of kernels.cu (by their
//! codes in `ops`), integer arithmetic and bit operations, comparisons and logic, Cast,
//! Where, Clip and RotaryEmbedding.

use super::{
    broadcast, broadcast_strides, strides, unsupported, Dev, KArgs, Kernel, Planner, Step, Val,
};
use crate::onnx::gpu::ops::{binary, compare, int, unary};
use crate::onnx::graph::{Dt, Node};
use crate::status::{Error, Result};

/// The `unary` code of a float operator `k_unary` computes, with its float parameters.
pub(super) fn unary_op(node: &Node) -> Option<(i64, [f32; 4])> {
    let one = |name: &str, default: f32| [node.float(name, default), 0.0, 0.0, 0.0];
    let two =
        |a: (&str, f32), b: (&str, f32)| [node.float(a.0, a.1), node.float(b.0, b.1), 0.0, 0.0];
    let none = [0.0; 4];
    Some(match node.op.as_str() {
        "Relu" => (unary::RELU, none),
        "Sigmoid" => (unary::SIGMOID, none),
        "Tanh" => (unary::TANH, none),
        "Erf" => (unary::ERF, none),
        "Gelu" if node.string("approximate").as_deref() == Some("tanh") => (unary::GELU_TANH, none),
        "Gelu" => (unary::GELU, none),
        "Exp" => (unary::EXP, none),
        "Log" => (unary::LOG, none),
        "Sqrt" => (unary::SQRT, none),
        "Neg" => (unary::NEG, none),
        "Abs" => (unary::ABS, none),
        "Reciprocal" => (unary::RECIPROCAL, none),
        "LeakyRelu" => (unary::LEAKY_RELU, one("alpha", 0.01)),
        "Floor" => (unary::FLOOR, none),
        "Ceil" => (unary::CEIL, none),
        "Round" => (unary::ROUND, none),
        "Sign" => (unary::SIGN, none),
        "Sin" => (unary::SIN, none),
        "Cos" => (unary::COS, none),
        "Tan" => (unary::TAN, none),
        "Asin" => (unary::ASIN, none),
        "Acos" => (unary::ACOS, none),
        "Atan" => (unary::ATAN, none),
        "Sinh" => (unary::SINH, none),
        "Cosh" => (unary::COSH, none),
        "Asinh" => (unary::ASINH, none),
        "Acosh" => (unary::ACOSH, none),
        "Atanh" => (unary::ATANH, none),
        "Softsign" => (unary::SOFTSIGN, none),
        "Softplus" => (unary::SOFTPLUS, none),
        "Mish" => (unary::MISH, none),
        "HardSwish" => (unary::HARD_SWISH, none),
        "Elu" => (unary::ELU, one("alpha", 1.0)),
        "Celu" => (unary::CELU, one("alpha", 1.0)),
        "Swish" => (unary::SWISH, one("alpha", 1.0)),
        "ThresholdedRelu" => (unary::THRESHOLDED_RELU, one("alpha", 1.0)),
        "Selu" => (
            unary::SELU,
            two(("alpha", 1.673_263_2), ("gamma", 1.050_701)),
        ),
        "Shrink" => (unary::SHRINK, two(("bias", 0.0), ("lambd", 0.5))),
        "HardSigmoid" => (unary::HARD_SIGMOID, two(("alpha", 0.2), ("beta", 0.5))),
        _ => return None,
    })
}

/// The `binary` code of a float operator `k_binary` computes (Sum and the variadic Max
/// and Min fold their inputs pairwise).
pub(super) fn binary_op(node: &Node) -> Option<i64> {
    Some(match node.op.as_str() {
        "Add" | "Sum" => binary::ADD,
        "Sub" => binary::SUB,
        "Mul" => binary::MUL,
        "Div" => binary::DIV,
        "Pow" => binary::POW,
        "Max" => binary::MAX,
        "Min" => binary::MIN,
        "PRelu" => binary::PRELU,
        // fmod = 1 keeps the dividend's sign, 0 the divisor's (as numpy).
        "Mod" if node.int("fmod", 0) != 0 => binary::FMOD,
        "Mod" => binary::MOD,
        _ => return None,
    })
}

impl Planner<'_> {
    /// Clip: bounds from attributes (before opset 11) or inputs; bounds computed on the
    /// device become a Max and a Min.
    pub(super) fn clip(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
        let (mut lo, mut hi) = (f32::MIN, f32::MAX);
        if opset >= 11 {
            let device_bounds = [1, 2]
                .iter()
                .any(|&i| node.input(i).is_some_and(|n| self.host(n).is_none()));
            if device_bounds {
                // Bounds computed on the device: max with min, then min with max.
                let mut y = self.x(node, 0)?;
                if node.input(1).is_some() {
                    let b = self.x(node, 1)?;
                    y = self.binary_of(node, binary::MAX, &y, &b)?;
                }
                if node.input(2).is_some() {
                    let b = self.x(node, 2)?;
                    y = self.binary_of(node, binary::MIN, &y, &b)?;
                }
                self.set(node, 0, Val::Dev(y));
                return Ok(());
            }
            let x = self.x(node, 0)?;
            if x.dt.is_int() {
                // Integer bounds, exactly (unsigned ones as their bits).
                let mut b = if x.dt.is_unsigned() {
                    [0, -1]
                } else {
                    [i64::MIN, i64::MAX]
                };
                for (i, v) in [1, 2].into_iter().zip(b.iter_mut()) {
                    if let Some(t) = node.input(i).and_then(|n| self.host(n)) {
                        *v = t.data.first().map_or(*v, |&f| {
                            if t.dt.is_unsigned() {
                                f as u64 as i64
                            } else {
                                f as i64
                            }
                        });
                    }
                }
                let y = self.int_op(node, int::CLIP, &x, None, (b[0], b[1]))?;
                self.set(node, 0, Val::Dev(y));
                return Ok(());
            }
            for (i, v) in [(1, &mut lo), (2, &mut hi)] {
                if let Some(n) = node.input(i) {
                    *v = match self.host(n) {
                        Some(t) => t.data.first().copied().unwrap_or(0.0) as f32,
                        None => return Err(self.want(node, n, "bound")),
                    };
                }
            }
        } else {
            lo = node.float("min", lo);
            hi = node.float("max", hi);
        }
        self.unary(node, unary::CLIP, [lo, hi, 0.0, 0.0])
    }

    /// BitwiseAnd, BitwiseOr, BitwiseXor, BitwiseNot and BitShift on integers.
    pub(super) fn bitwise(&mut self, node: &Node) -> Result<()> {
        let op = match node.op.as_str() {
            "BitwiseAnd" => int::AND,
            "BitwiseOr" => int::OR,
            "BitwiseXor" => int::XOR,
            "BitwiseNot" => int::NOT,
            _ => match node.string("direction").as_deref() {
                Some("LEFT") => int::SHL,
                Some("RIGHT") => int::SHR,
                other => {
                    return Err(Error::invalid(format!(
                        "{}: direction {other:?} (LEFT or RIGHT)",
                        node.label()
                    )))
                }
            },
        };
        let x = self.x(node, 0)?;
        let b = if op == int::NOT {
            None
        } else {
            Some(self.x(node, 1)?)
        };
        let y = self.int_op(node, op, &x, b.as_ref(), (0, 0))?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// Cast and CastLike.
    pub(super) fn cast_node(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let to = if node.op == "CastLike" {
            self.x(node, 1)?.dt
        } else {
            let to = Dt::from_onnx(node.int("to", 1) as i32)
                .ok_or_else(|| unsupported(node, "this target type"))?;
            self.compute_type(to)
        };
        if to == x.dt {
            let shape = x.shape.clone();
            self.alias(node, &x, shape);
            return Ok(());
        }
        let y = self.temp(to, x.shape.clone());
        self.cast(&x, &y);
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// Where: condition ? X : Y, broadcast.
    pub(super) fn where_node(&mut self, node: &Node) -> Result<()> {
        let c = self.x(node, 0)?;
        let a = self.x(node, 1)?;
        let b = self.x(node, 2)?;
        if c.dt != Dt::Bool || a.dt != b.dt {
            return Err(Error::invalid(format!(
                "{}: a BOOL condition and two inputs of one type are needed, got {}, {} and {}",
                node.label(),
                c.dt.name(),
                a.dt.name(),
                b.dt.name()
            )));
        }
        let shape = broadcast(&c.shape, &a.shape)
            .and_then(|s| broadcast(&s, &b.shape))
            .ok_or_else(|| Error::invalid(format!("{}: shapes do not broadcast", node.label())))?;
        let y = self.temp(a.dt, shape.clone());
        let size = a.dt.size() as i64;
        let ins = [
            (&c, broadcast_strides(&c.shape, &shape), 0),
            (&a, broadcast_strides(&a.shape, &shape), 0),
            (&b, broadcast_strides(&b.shape, &shape), 0),
        ];
        self.strided(
            node,
            Kernel::Where,
            &shape,
            &ins,
            &y.ptr,
            &strides(&shape),
            0,
            |k| k.p[1] = size,
        )?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    pub(super) fn unary(&mut self, node: &Node, op: i64, f: [f32; 4]) -> Result<()> {
        let x = self.x(node, 0)?;
        if x.dt.is_int() {
            let iop = match op {
                unary::NEG => int::NEG,
                unary::ABS => int::ABS,
                unary::SIGN => int::SIGN,
                unary::RELU if x.dt.is_unsigned() => {
                    // Relu of an unsigned integer: itself.
                    self.alias(node, &x, x.shape.clone());
                    return Ok(());
                }
                _ => return Err(unsupported(node, format!("{} tensors", x.dt.name()))),
            };
            let y = self.int_op(node, iop, &x, None, (0, 0))?;
            self.set(node, 0, Val::Dev(y));
            return Ok(());
        }
        let ft = Self::ft(node, &x)?;
        let y = self.temp(x.dt, x.shape.clone());
        let s = strides(&x.shape);
        self.strided(
            node,
            Kernel::Unary,
            &x.shape,
            &[(&x, s.clone(), 0)],
            &y.ptr,
            &s,
            0,
            |a| {
                a.p[0] = op;
                a.f = f;
                a.ft = ft;
            },
        )?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    pub(super) fn binary_of(&mut self, node: &Node, op: i64, a: &Dev, b: &Dev) -> Result<Dev> {
        if a.dt.is_int() || b.dt.is_int() {
            let iop = match op {
                binary::ADD => int::ADD,
                binary::SUB => int::SUB,
                binary::MUL => int::MUL,
                binary::DIV => int::DIV,
                binary::POW => int::POW,
                binary::MAX => int::MAX,
                binary::MIN => int::MIN,
                binary::MOD => int::MOD,
                binary::FMOD => int::FMOD,
                _ => return Err(unsupported(node, format!("{} tensors", a.dt.name()))),
            };
            return self.int_op(node, iop, a, Some(b), (0, 0));
        }
        let ft = Self::ft_all(node, &[a, b])?;
        let shape = broadcast(&a.shape, &b.shape).ok_or_else(|| {
            Error::invalid(format!(
                "{}: shapes {:?} and {:?} do not broadcast",
                node.label(),
                a.shape,
                b.shape
            ))
        })?;
        let y = self.temp(a.dt, shape.clone());
        let (sa, sb) = (
            broadcast_strides(&a.shape, &shape),
            broadcast_strides(&b.shape, &shape),
        );
        self.strided(
            node,
            Kernel::Binary,
            &shape,
            &[(a, sa, 0), (b, sb, 0)],
            &y.ptr,
            &strides(&shape),
            0,
            |k| {
                k.p[0] = op;
                k.ft = ft;
            },
        )?;
        Ok(y)
    }

    pub(super) fn binary(&mut self, node: &Node, op: i64) -> Result<()> {
        let mut acc = self.x(node, 0)?;
        for i in 1..node.inputs.len() {
            let b = self.x(node, i)?;
            acc = self.binary_of(node, op, &acc, &b)?;
        }
        self.set(node, 0, Val::Dev(acc));
        Ok(())
    }

    /// Comparisons and logic into BOOL (`infer_compare`).
    pub(super) fn compare(&mut self, node: &Node) -> Result<()> {
        let op = match node.op.as_str() {
            "Equal" => compare::EQUAL,
            "Less" => compare::LESS,
            "Greater" => compare::GREATER,
            "LessOrEqual" => compare::LESS_OR_EQUAL,
            "GreaterOrEqual" => compare::GREATER_OR_EQUAL,
            "And" => compare::AND,
            "Or" => compare::OR,
            "Xor" => compare::XOR,
            "Not" => compare::NOT,
            "IsNaN" => compare::IS_NAN,
            _ => compare::IS_INF,
        };
        let a = self.x(node, 0)?;
        let ins = if op >= compare::NOT {
            vec![a]
        } else {
            vec![a, self.x(node, 1)?]
        };
        for d in &ins {
            let ok = match op {
                compare::AND | compare::OR | compare::XOR | compare::NOT => d.dt == Dt::Bool,
                compare::IS_NAN | compare::IS_INF => d.dt.is_float(),
                _ => true,
            };
            if !ok {
                return Err(Error::invalid(format!(
                    "{}: an input of type {}",
                    node.label(),
                    d.dt.name()
                )));
            }
        }
        let shape = match ins.as_slice() {
            [x, y] => broadcast(&x.shape, &y.shape).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: shapes {:?} and {:?} do not broadcast",
                    node.label(),
                    x.shape,
                    y.shape
                ))
            })?,
            _ => ins[0].shape.clone(),
        };
        let y = self.temp(Dt::Bool, shape.clone());
        let codes: Vec<i64> = ins.iter().map(|d| d.dt.cast_code()).collect();
        let spec: Vec<(&Dev, Vec<i64>, i64)> = ins
            .iter()
            .map(|d| (d, broadcast_strides(&d.shape, &shape), 0))
            .collect();
        let (pos, neg) = (
            node.int("detect_positive", 1) != 0,
            node.int("detect_negative", 1) != 0,
        );
        self.strided(
            node,
            Kernel::Compare,
            &shape,
            &spec,
            &y.ptr,
            &strides(&shape),
            0,
            |k| {
                k.p[0] = op;
                k.p[1] = codes[0];
                k.p[2] = codes.get(1).copied().unwrap_or(0);
                k.p[3] = i64::from(pos);
                k.p[4] = i64::from(neg);
            },
        )?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// Integer arithmetic (`infer_int`, op codes there) on `a` and, for the binary ops,
    /// `b` broadcast against it; both of one integer type. `clip`: Clip's bounds.
    pub(super) fn int_op(
        &mut self,
        node: &Node,
        op: i64,
        a: &Dev,
        b: Option<&Dev>,
        clip: (i64, i64),
    ) -> Result<Dev> {
        if !a.dt.is_int() || b.is_some_and(|b| b.dt != a.dt) {
            return Err(match b {
                Some(b) if a.dt.is_int() || b.dt.is_int() => Error::invalid(format!(
                    "{}: operands of types {} and {}",
                    node.label(),
                    a.dt.name(),
                    b.dt.name()
                )),
                _ => unsupported(node, format!("{} tensors", a.dt.name())),
            });
        }
        let shape = match b {
            Some(b) => broadcast(&a.shape, &b.shape).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: shapes {:?} and {:?} do not broadcast",
                    node.label(),
                    a.shape,
                    b.shape
                ))
            })?,
            None => a.shape.clone(),
        };
        let y = self.temp(a.dt, shape.clone());
        let mut ins = vec![(a, broadcast_strides(&a.shape, &shape), 0)];
        if let Some(b) = b {
            ins.push((b, broadcast_strides(&b.shape, &shape), 0));
        }
        let (code, uns) = (a.dt.cast_code(), i64::from(a.dt.is_unsigned()));
        self.strided(
            node,
            Kernel::Int,
            &shape,
            &ins,
            &y.ptr,
            &strides(&shape),
            0,
            |k| {
                k.p[0] = op;
                k.p[1] = code;
                k.p[2] = uns;
                k.p[3] = clip.0;
                k.p[4] = clip.1;
            },
        )?;
        Ok(y)
    }

    /// RotaryEmbedding (opset 23): `infer_rope`, one launch.
    pub(super) fn rope(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let cos = self.x(node, 1)?;
        let sin = self.x(node, 2)?;
        let ft = Self::ft_all(node, &[&x, &cos, &sin])?;
        let bad = |why: String| Error::invalid(format!("{}: {why}", node.label()));
        let (b, s, h, d, bshd) = match x.shape[..] {
            [b, h, s, d] => (b, s, h, d, 0),
            [b, s, hidden] => {
                let h = node.int("num_heads", 0);
                if h <= 0 || hidden % h != 0 {
                    return Err(bad(format!(
                        "a 3-D input of hidden size {hidden} needs num_heads dividing it"
                    )));
                }
                (b, s, h, hidden / h, 1)
            }
            _ => return Err(bad(format!("input {:?} (3-D or 4-D)", x.shape))),
        };
        let rot = match node.int("rotary_embedding_dim", 0) {
            0 => d,
            r => r,
        };
        if rot <= 0 || rot > d || rot % 2 != 0 {
            return Err(bad(format!(
                "rotary_embedding_dim {rot} for a head size of {d}"
            )));
        }
        let half = rot / 2;
        let ids = match node.input(3) {
            Some(_) => Some(self.x(node, 3)?),
            None => None,
        };
        let rows = match &ids {
            Some(p) => {
                if p.dt != Dt::I64 || p.shape != [b, s] {
                    return Err(bad(format!(
                        "position_ids are {} {:?}, not INT64 [{b}, {s}]",
                        p.dt.name(),
                        p.shape
                    )));
                }
                if cos.shape.len() != 2 || cos.shape[1] != half {
                    return Err(bad(format!("cos_cache {:?} (rows, {half})", cos.shape)));
                }
                cos.shape[0]
            }
            None => {
                if cos.shape != [b, s, half] {
                    return Err(bad(format!(
                        "cos_cache {:?} (not [{b}, {s}, {half}])",
                        cos.shape
                    )));
                }
                b * s
            }
        };
        if sin.shape != cos.shape {
            return Err(bad(format!(
                "sin_cache {:?} and cos_cache {:?} differ",
                sin.shape, cos.shape
            )));
        }
        let y = self.temp(x.dt, x.shape.clone());
        let mut k = KArgs {
            n: x.numel(),
            ..KArgs::default()
        };
        let inter = i64::from(node.int("interleaved", 0) != 0);
        k.p[..9].copy_from_slice(&[b, s, h, d, rot, inter, bshd, i64::from(ids.is_some()), rows]);
        k.ft = ft;
        self.push(Step::Kernel {
            k: Kernel::Rope,
            args: Box::new(k),
            ins: [
                Some(x.ptr.clone()),
                Some(cos.ptr.clone()),
                Some(sin.ptr.clone()),
                ids.as_ref().map(|p| p.ptr.clone()),
            ],
            out: y.ptr.clone(),
        });
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }
}
