//! What a plan is made of: the steps the executor queues (kernel launches, GEMMs,
//! copies) and the buffers they name. Shared by the planner, the fusion pass and the
//! executor; no planning here.

use crate::cuda::cublas::GemmArgs;
use crate::cuda::driver::DeviceMem;
use crate::onnx::gpu::kargs::{KArgs, Kernel};
use std::sync::Arc;

/// Where a tensor's bytes are, resolved to an address when the plan runs.
#[derive(Clone)]
pub enum Buf {
    /// Batch input `k` (graph input order).
    Input(usize),
    /// Graph output `k`.
    Output(usize),
    /// Intermediate `k` (an offset of the arena).
    Temp(usize),
    /// A constant on the device.
    Const(Arc<DeviceMem>),
}

#[derive(Clone)]
pub struct Ptr {
    pub buf: Buf,
    /// Byte offset into the buffer.
    pub bytes: u64,
}

impl Ptr {
    /// The same buffer, `bytes` further on.
    pub fn plus(&self, bytes: u64) -> Ptr {
        Ptr {
            buf: self.buf.clone(),
            bytes: self.bytes + bytes,
        }
    }
}

/// One unit of a plan's work, queued in order on the instance's stream.
pub enum Step {
    Kernel {
        k: Kernel,
        args: Box<KArgs>,
        ins: [Option<Ptr>; 4],
        out: Ptr,
    },
    Gemm {
        g: GemmArgs,
        a: Ptr,
        b: Ptr,
        c: Ptr,
    },
    Copy {
        dst: Ptr,
        src: Ptr,
        bytes: u64,
    },
}
