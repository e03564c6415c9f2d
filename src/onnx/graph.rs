//! The ONNX graph reader the executors share: a model file read straight from its
//! protobuf (tract's parser keeps the message types public) into constant tensors in host
//! memory, nodes with their attributes, and the graph's inputs and outputs. The GPU
//! executor plans from it; the CPU executor completes configs from it where tract cannot
//! read a file.

use crate::status::{Error, Result};
use tract_onnx::pb;

/// Element types the executor knows (ONNX TensorProto.DataType codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dt {
    F32,
    U8,
    I8,
    I32,
    I64,
    Bool,
    F64,
    F16,
    BF16,
    U16,
    I16,
    U32,
    U64,
}

impl Dt {
    pub fn from_onnx(code: i32) -> Option<Dt> {
        Some(match code {
            1 => Dt::F32,
            2 => Dt::U8,
            3 => Dt::I8,
            6 => Dt::I32,
            7 => Dt::I64,
            9 => Dt::Bool,
            10 => Dt::F16,
            11 => Dt::F64,
            16 => Dt::BF16,
            4 => Dt::U16,
            5 => Dt::I16,
            12 => Dt::U32,
            13 => Dt::U64,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Dt::U8 | Dt::I8 | Dt::Bool => 1,
            Dt::F16 | Dt::BF16 | Dt::U16 | Dt::I16 => 2,
            Dt::F32 | Dt::I32 | Dt::U32 => 4,
            Dt::I64 | Dt::F64 | Dt::U64 => 8,
        }
    }
    /// The type code of `infer_cast` (kernels.cu).
    pub fn cast_code(self) -> i64 {
        match self {
            Dt::F32 => 0,
            Dt::U8 => 1,
            Dt::I8 => 2,
            Dt::I32 => 3,
            Dt::I64 => 4,
            Dt::Bool => 5,
            Dt::F64 => 10,
            Dt::F16 => 11,
            Dt::BF16 => 12,
            Dt::U16 => 6,
            Dt::I16 => 7,
            Dt::U32 => 8,
            Dt::U64 => 9,
        }
    }
    /// An integer type (BOOL is not).
    pub fn is_int(self) -> bool {
        matches!(
            self,
            Dt::U8 | Dt::I8 | Dt::I32 | Dt::I64 | Dt::U16 | Dt::I16 | Dt::U32 | Dt::U64
        )
    }
    /// An unsigned integer type.
    pub fn is_unsigned(self) -> bool {
        matches!(self, Dt::U8 | Dt::U16 | Dt::U32 | Dt::U64)
    }
    /// A floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, Dt::F32 | Dt::F64 | Dt::F16 | Dt::BF16)
    }
    /// The code of a float kernel's element type (`infer_kargs.ft`), for the types the
    /// float kernels read and write.
    pub fn float_code(self) -> Option<i64> {
        match self {
            Dt::F32 => Some(0),
            Dt::F16 => Some(1),
            Dt::BF16 => Some(2),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dt::F32 => "FLOAT",
            Dt::U8 => "UINT8",
            Dt::I8 => "INT8",
            Dt::I32 => "INT32",
            Dt::I64 => "INT64",
            Dt::Bool => "BOOL",
            Dt::F64 => "DOUBLE",
            Dt::F16 => "FLOAT16",
            Dt::BF16 => "BFLOAT16",
            Dt::U16 => "UINT16",
            Dt::I16 => "INT16",
            Dt::U32 => "UINT32",
            Dt::U64 => "UINT64",
        }
    }
    pub fn to_library(self) -> Option<crate::tensor::DataType> {
        use crate::tensor::DataType as L;
        Some(match self {
            Dt::F32 => L::Fp32,
            Dt::U8 => L::Uint8,
            Dt::I8 => L::Int8,
            Dt::I32 => L::Int32,
            Dt::I64 => L::Int64,
            Dt::Bool => L::Bool,
            Dt::F64 => L::Fp64,
            Dt::F16 => L::Fp16,
            Dt::BF16 => L::Bf16,
            Dt::U16 => L::Uint16,
            Dt::I16 => L::Int16,
            Dt::U32 => L::Uint32,
            Dt::U64 => L::Uint64,
        })
    }
    pub fn from_library(d: crate::tensor::DataType) -> Option<Dt> {
        use crate::tensor::DataType as L;
        Some(match d {
            L::Fp32 => Dt::F32,
            L::Uint8 => Dt::U8,
            L::Int8 => Dt::I8,
            L::Int32 => Dt::I32,
            L::Int64 => Dt::I64,
            L::Bool => Dt::Bool,
            L::Fp64 => Dt::F64,
            L::Fp16 => Dt::F16,
            L::Bf16 => Dt::BF16,
            L::Uint16 => Dt::U16,
            L::Int16 => Dt::I16,
            L::Uint32 => Dt::U32,
            L::Uint64 => Dt::U64,
            _ => return None,
        })
    }
}

/// A tensor in host memory. Values are kept as f64 (exact for every integer a shape
/// computation meets, and for f32), with the element type they have in the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dt: Dt,
    pub shape: Vec<i64>,
    pub data: Vec<f64>,
}

impl HostTensor {
    pub fn scalar_i64(v: i64) -> HostTensor {
        HostTensor {
            dt: Dt::I64,
            shape: Vec::new(),
            data: vec![v as f64],
        }
    }
    pub fn vec_i64(v: &[i64]) -> HostTensor {
        HostTensor {
            dt: Dt::I64,
            shape: vec![v.len() as i64],
            data: v.iter().map(|&x| x as f64).collect(),
        }
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn as_i64(&self) -> Vec<i64> {
        self.data.iter().map(|&x| x as i64).collect()
    }
    /// A tensor from its little-endian bytes; None when their count does not match.
    pub fn from_bytes(dt: Dt, shape: &[i64], raw: &[u8]) -> Option<HostTensor> {
        let count = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))?;
        (count.checked_mul(dt.size())? == raw.len()).then(|| HostTensor {
            dt,
            shape: shape.to_vec(),
            data: HostTensor::decode(dt, raw),
        })
    }
    /// Little-endian elements of type `dt` as f64 (a trailing partial element is ignored).
    fn decode(dt: Dt, raw: &[u8]) -> Vec<f64> {
        let c = raw.chunks_exact(dt.size());
        match dt {
            Dt::F32 => c
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
                .collect(),
            Dt::F64 => c
                .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                .collect(),
            Dt::U8 | Dt::Bool => c.map(|b| b[0] as f64).collect(),
            Dt::I8 => c.map(|b| b[0] as i8 as f64).collect(),
            Dt::I32 => c
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
                .collect(),
            Dt::I64 => c
                .map(|b| {
                    i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f64
                })
                .collect(),
            Dt::F16 => c
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
                .collect(),
            Dt::BF16 => c
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
                .collect(),
            Dt::U16 => c.map(|b| u16::from_le_bytes([b[0], b[1]]) as f64).collect(),
            Dt::I16 => c.map(|b| i16::from_le_bytes([b[0], b[1]]) as f64).collect(),
            Dt::U32 => c
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
                .collect(),
            Dt::U64 => c
                .map(|b| {
                    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f64
                })
                .collect(),
        }
    }
    /// The bytes of the tensor in its element type (little endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data.len() * self.dt.size());
        for &x in &self.data {
            match self.dt {
                Dt::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
                Dt::F64 => out.extend_from_slice(&x.to_le_bytes()),
                Dt::U8 => out.push(x as u8),
                Dt::I8 => out.push(x as i8 as u8),
                Dt::Bool => out.push(u8::from(x != 0.0)),
                Dt::I32 => out.extend_from_slice(&(x as i32).to_le_bytes()),
                Dt::I64 => out.extend_from_slice(&(x as i64).to_le_bytes()),
                Dt::U16 => out.extend_from_slice(&(x as u16).to_le_bytes()),
                Dt::I16 => out.extend_from_slice(&(x as i16).to_le_bytes()),
                Dt::U32 => out.extend_from_slice(&(x as u32).to_le_bytes()),
                Dt::U64 => out.extend_from_slice(&(x as u64).to_le_bytes()),
                Dt::F16 => out.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
                Dt::BF16 => out.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            }
        }
        out
    }
    /// Rounds values to what the element type can hold (after arithmetic in f64).
    pub fn normalize(mut self) -> HostTensor {
        for x in &mut self.data {
            *x = match self.dt {
                Dt::F32 => *x as f32 as f64,
                Dt::F64 => *x,
                Dt::U8 => (*x as u8) as f64,
                Dt::I8 => (*x as i8) as f64,
                Dt::Bool => f64::from(u8::from(*x != 0.0)),
                Dt::I32 => (*x as i32) as f64,
                Dt::I64 => (*x as i64) as f64,
                Dt::U16 => (*x as u16) as f64,
                Dt::I16 => (*x as i16) as f64,
                Dt::U32 => (*x as u32) as f64,
                Dt::U64 => (*x as u64) as f64,
                Dt::F16 => half::f16::from_f64(*x).to_f64(),
                Dt::BF16 => half::bf16::from_f64(*x).to_f64(),
            };
        }
        self
    }
}

/// Reads a TensorProto (raw or typed data; external data is not supported).
pub fn tensor_from_proto(t: &pb::TensorProto, what: &str) -> Result<HostTensor> {
    let dt = Dt::from_onnx(t.data_type).ok_or_else(|| {
        Error::unsupported(format!(
            "{what}: tensor '{}' has ONNX data type {}, which the GPU executor does not support",
            t.name, t.data_type
        ))
    })?;
    if !t.external_data.is_empty() {
        return Err(Error::unsupported(format!(
            "{what}: tensor '{}' keeps its data in an external file, which the GPU executor does not read",
            t.name
        )));
    }
    let shape: Vec<i64> = t.dims.clone();
    if shape.iter().any(|&d| d < 0) {
        return Err(Error::invalid(format!(
            "{what}: tensor '{}' has a negative dimension",
            t.name
        )));
    }
    let count = shape.iter().product::<i64>() as usize;
    let raw = &t.raw_data;
    let data: Vec<f64> = if !raw.is_empty() {
        if raw.len() != count * dt.size() {
            return Err(Error::invalid(format!(
                "{what}: tensor '{}' has {} bytes of data for {count} elements of {}",
                t.name,
                raw.len(),
                dt.name()
            )));
        }
        HostTensor::decode(dt, raw)
    } else {
        match dt {
            Dt::F32 => t.float_data.iter().map(|&x| x as f64).collect(),
            Dt::F64 => t.double_data.clone(),
            Dt::I64 => t.int64_data.iter().map(|&x| x as f64).collect(),
            Dt::U8 | Dt::I8 | Dt::Bool | Dt::I32 | Dt::U16 | Dt::I16 => {
                t.int32_data.iter().map(|&x| x as f64).collect()
            }
            Dt::U32 | Dt::U64 => t.uint64_data.iter().map(|&x| x as f64).collect(),
            // 16-bit floats are kept as their bit patterns in int32_data.
            Dt::F16 => t
                .int32_data
                .iter()
                .map(|&x| half::f16::from_bits(x as u16).to_f64())
                .collect(),
            Dt::BF16 => t
                .int32_data
                .iter()
                .map(|&x| half::bf16::from_bits(x as u16).to_f64())
                .collect(),
        }
    };
    if data.len() != count {
        return Err(Error::invalid(format!(
            "{what}: tensor '{}' has {} values for shape {:?}",
            t.name,
            data.len(),
            shape
        )));
    }
    Ok(HostTensor { dt, shape, data }.normalize())
}

/// A node's attribute values, by name.
pub struct Node {
    pub op: String,
    pub name: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    attrs: Vec<pb::AttributeProto>,
}

impl Node {
    /// A node the executor makes itself (an operator expanded into others).
    pub fn new(op: &str, name: String, inputs: Vec<String>, outputs: Vec<String>) -> Node {
        Node {
            op: op.to_owned(),
            name,
            inputs,
            outputs,
            attrs: Vec::new(),
        }
    }
    /// With integer attribute `name` set to `v`.
    pub fn with_int(mut self, name: &str, v: i64) -> Node {
        self.attrs.push(pb::AttributeProto {
            name: name.to_owned(),
            i: v,
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            ..Default::default()
        });
        self
    }
    /// With integer-list attribute `name` set to `v`.
    pub fn with_ints(mut self, name: &str, v: &[i64]) -> Node {
        self.attrs.push(pb::AttributeProto {
            name: name.to_owned(),
            ints: v.to_vec(),
            r#type: pb::attribute_proto::AttributeType::Ints as i32,
            ..Default::default()
        });
        self
    }
    /// With string attribute `name` set to `v`.
    pub fn with_string(mut self, name: &str, v: &str) -> Node {
        self.attrs.push(pb::AttributeProto {
            name: name.to_owned(),
            s: v.as_bytes().to_vec(),
            r#type: pb::attribute_proto::AttributeType::String as i32,
            ..Default::default()
        });
        self
    }
    pub fn from_proto(n: &pb::NodeProto) -> Node {
        Node {
            op: n.op_type.clone(),
            name: n.name.clone(),
            inputs: n.input.clone(),
            outputs: n.output.clone(),
            attrs: n.attribute.clone(),
        }
    }
    /// "Conv 'conv1'" for messages.
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            format!(
                "{} (output '{}')",
                self.op,
                self.outputs.first().map_or("", |s| s)
            )
        } else {
            format!("{} '{}'", self.op, self.name)
        }
    }
    fn attr(&self, name: &str) -> Option<&pb::AttributeProto> {
        self.attrs.iter().find(|a| a.name == name)
    }
    pub fn has(&self, name: &str) -> bool {
        self.attr(name).is_some()
    }
    pub fn int(&self, name: &str, default: i64) -> i64 {
        self.attr(name).map_or(default, |a| a.i)
    }
    pub fn float(&self, name: &str, default: f32) -> f32 {
        self.attr(name).map_or(default, |a| a.f)
    }
    pub fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).map(|a| a.ints.clone())
    }
    pub fn string(&self, name: &str) -> Option<String> {
        self.attr(name)
            .map(|a| String::from_utf8_lossy(&a.s).into_owned())
    }
    pub fn tensor(&self, name: &str) -> Option<&pb::TensorProto> {
        self.attr(name).and_then(|a| a.t.as_ref())
    }
    /// Input `i`, or None when absent or given as "" (an omitted optional input).
    pub fn input(&self, i: usize) -> Option<&str> {
        self.inputs
            .get(i)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
}

/// A graph input or output: its name, element type and dims (-1 for a symbolic dim).
#[derive(Clone, Debug)]
pub struct Io {
    pub name: String,
    pub dt: Option<Dt>,
    pub dims: Option<Vec<i64>>,
}

fn io_from(v: &pb::ValueInfoProto) -> Io {
    let mut io = Io {
        name: v.name.clone(),
        dt: None,
        dims: None,
    };
    if let Some(pb::type_proto::Value::TensorType(t)) =
        v.r#type.as_ref().and_then(|t| t.value.as_ref())
    {
        io.dt = Dt::from_onnx(t.elem_type);
        io.dims = t.shape.as_ref().map(|s| {
            s.dim
                .iter()
                .map(|d| match d.value {
                    Some(pb::tensor_shape_proto::dimension::Value::DimValue(v)) => v,
                    _ => -1,
                })
                .collect()
        });
    }
    io
}

/// The whole graph.
pub struct Graph {
    pub inputs: Vec<Io>,
    pub outputs: Vec<Io>,
    /// Shared with every plan made of the graph (planning clones none of them).
    pub initializers: Vec<(String, std::sync::Arc<HostTensor>)>,
    pub nodes: Vec<Node>,
    /// The default-domain opset.
    pub opset: i64,
}

impl Graph {
    /// Reads the ONNX file at `file`; `what` names the model in errors.
    pub fn read(file: &std::path::Path, what: &str) -> Result<Graph> {
        use tract_onnx::prelude::Framework;
        let proto = tract_onnx::onnx()
            .proto_model_for_path(file)
            .map_err(|e| Error::invalid(format!("{what}: cannot read {}: {e}", file.display())))?;
        Graph::from_proto(&proto, what)
    }

    pub fn from_proto(m: &pb::ModelProto, what: &str) -> Result<Graph> {
        let g = m
            .graph
            .as_ref()
            .ok_or_else(|| Error::invalid(format!("{what}: the ONNX file has no graph")))?;
        let opset = m
            .opset_import
            .iter()
            .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
            .map_or(17, |o| o.version);
        let mut initializers = Vec::with_capacity(g.initializer.len());
        for t in &g.initializer {
            initializers.push((
                t.name.clone(),
                std::sync::Arc::new(tensor_from_proto(t, what)?),
            ));
        }
        let inits: std::collections::HashSet<&str> =
            g.initializer.iter().map(|t| t.name.as_str()).collect();
        Ok(Graph {
            inputs: g
                .input
                .iter()
                .filter(|i| !inits.contains(i.name.as_str()))
                .map(io_from)
                .collect(),
            outputs: g.output.iter().map(io_from).collect(),
            initializers,
            nodes: g.node.iter().map(Node::from_proto).collect(),
            opset,
        })
    }
}
