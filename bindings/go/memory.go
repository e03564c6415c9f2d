package infer

/*
#include "infer.h"
*/
import "C"

import "fmt"

// MemoryType says where a tensor's bytes live (infer_memory_type).
type MemoryType uint32

// The memory types, as in include/infer.h.
const (
	MemoryCPU       MemoryType = C.INFER_MEMORY_CPU        // ordinary host memory
	MemoryCPUPinned MemoryType = C.INFER_MEMORY_CPU_PINNED // page-locked host memory (a GPU copies it directly)
	MemoryGPU       MemoryType = C.INFER_MEMORY_GPU        // device memory of one GPU
)

// String returns "CPU", "CPU_PINNED" or "GPU" ("MemoryType(N)" for other values).
func (m MemoryType) String() string {
	switch m {
	case MemoryCPU:
		return "CPU"
	case MemoryCPUPinned:
		return "CPU_PINNED"
	case MemoryGPU:
		return "GPU"
	}
	return fmt.Sprintf("MemoryType(%d)", uint32(m))
}

// DeviceTensor is an output in GPU memory: its description and the device address of
// its bytes. Ptr is not Go memory and not host memory: never convert it to a Go pointer
// or read it on the host; hand it to CUDA code for device DeviceID. It is valid until the
// Response it came from is closed, and the work that produced it is complete.
type DeviceTensor struct {
	Name     string
	DataType DataType
	Shape    []int64 // for a model that batches, dim 0 is this request's batch size
	Ptr      uintptr // device address (a CUdeviceptr)
	ByteSize int
	DeviceID int64
}

// ElementCount returns the number of elements the shape describes.
func (t *DeviceTensor) ElementCount() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= d
	}
	return n
}
