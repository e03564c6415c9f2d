//! `add_sub`: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, element-wise, for
//! INT32, INT64, FP32 and FP64 inputs of equal shape.

use super::typed;
use crate::backend::{simulate_compute, Backend, Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::status::{Error, Result};
use crate::tensor::{shape_string, DataType};
use std::sync::Arc;

pub struct AddSub;

struct AddSubInstance {
    dtype: DataType,
    delay_us: u64,
}

const INPUTS: [&str; 2] = ["INPUT0", "INPUT1"];
const OUTPUTS: [&str; 2] = ["OUTPUT0", "OUTPUT1"];

impl Backend for AddSub {
    fn create_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        _index: u32,
        _gpu: i32,
    ) -> Result<Box<dyn ModelInstance>> {
        let name = &config.name;
        let mut dtype = None;
        for t in INPUTS
            .iter()
            .map(|n| (n, config.input(n)))
            .chain(OUTPUTS.iter().map(|n| (n, config.output(n))))
        {
            let tc = t.1.ok_or_else(|| {
                Error::invalid(format!(
                    "model '{name}': the add_sub backend needs inputs INPUT0, INPUT1 and outputs OUTPUT0, OUTPUT1; '{}' is missing",
                    t.0
                ))
            })?;
            match dtype {
                None => dtype = Some(tc.data_type),
                Some(d) if d != tc.data_type => {
                    return Err(Error::invalid(format!(
                        "model '{name}': add_sub tensors must share one datatype; '{}' is {}, expected {}",
                        t.0,
                        tc.data_type.as_str(),
                        d.as_str()
                    )))
                }
                _ => {}
            }
        }
        let dtype = dtype.unwrap_or(DataType::Fp32);
        if !matches!(
            dtype,
            DataType::Int32 | DataType::Int64 | DataType::Fp32 | DataType::Fp64
        ) {
            return Err(Error::unsupported(format!(
                "model '{name}': the add_sub backend supports INT32, INT64, FP32 and FP64, not {}",
                dtype.as_str()
            )));
        }
        Ok(Box::new(AddSubInstance {
            dtype,
            delay_us: super::execute_delay_us(config)?,
        }))
    }
}

fn add_sub<T: bytemuck::Pod>(
    a: &[u8],
    b: &[u8],
    add: impl Fn(T, T) -> T,
    sub: impl Fn(T, T) -> T,
) -> (Vec<u8>, Vec<u8>) {
    let (a, b) = (typed::<T>(a), typed::<T>(b));
    let sum: Vec<T> = a.iter().zip(b.iter()).map(|(x, y)| add(*x, *y)).collect();
    let diff: Vec<T> = a.iter().zip(b.iter()).map(|(x, y)| sub(*x, *y)).collect();
    (
        bytemuck::cast_slice(&sum).to_vec(),
        bytemuck::cast_slice(&diff).to_vec(),
    )
}

impl ModelInstance for AddSubInstance {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        simulate_compute(self.delay_us);
        let model = &batch.config.name;
        let (i0, a) = batch
            .input(INPUTS[0])
            .ok_or_else(|| Error::invalid(format!("model '{model}': INPUT0 missing")))?;
        let (i1, b) = batch
            .input(INPUTS[1])
            .ok_or_else(|| Error::invalid(format!("model '{model}': INPUT1 missing")))?;
        if i0.shape != i1.shape {
            return Err(Error::invalid(format!(
                "model '{model}': INPUT0 shape {} and INPUT1 shape {} differ",
                shape_string(&i0.shape),
                shape_string(&i1.shape)
            )));
        }
        let shape = i0.shape.clone();
        let (sum, diff) = match self.dtype {
            DataType::Int32 => add_sub::<i32>(a, b, i32::wrapping_add, i32::wrapping_sub),
            DataType::Int64 => add_sub::<i64>(a, b, i64::wrapping_add, i64::wrapping_sub),
            DataType::Fp64 => add_sub::<f64>(a, b, |x, y| x + y, |x, y| x - y),
            _ => add_sub::<f32>(a, b, |x, y| x + y, |x, y| x - y),
        };
        for (name, bytes) in OUTPUTS.iter().zip([sum, diff]) {
            if batch.requests.iter().any(|r| r.wants_output(name)) {
                batch
                    .alloc_output(name, &shape, None)?
                    .copy_from_slice(&bytes);
            }
        }
        Ok(())
    }
}
