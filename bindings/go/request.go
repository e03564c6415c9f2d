package infer

/*
#include "bridge.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"runtime/cgo"
	"time"
	"unsafe"
)

// RequestFlags mark a request's place in a sequence.
type RequestFlags uint32

// Sequence flags (INFER_REQUEST_FLAG_*).
const (
	SequenceStart RequestFlags = C.INFER_REQUEST_FLAG_SEQUENCE_START
	SequenceEnd   RequestFlags = C.INFER_REQUEST_FLAG_SEQUENCE_END
)

// Request is an inference request being built. Inputs from Go memory are copied into
// the library when added, so the caller's slices may be reused at once (device inputs,
// AddInputDevice, are borrowed instead). A Request is used by one goroutine
// at a time. Sending it (Server.Infer, Server.Stream, Server.Enqueue, Sequence.Send)
// consumes it, also when sending fails; a Request that is never sent is released by
// Close.
type Request struct {
	ptr   *C.infer_request
	model string
}

// NewRequest creates a request for a model version (LatestVersion for the latest).
func (s *Server) NewRequest(model string, version int64) (*Request, error) {
	cmodel, err := cString("model name", model)
	if err != nil {
		return nil, err
	}
	defer freeCString(cmodel)
	var p *C.infer_request
	err = s.use(func(sp *C.infer_server) error {
		return call(func() C.infer_status {
			return C.infer_request_new(sp, cmodel, C.int64_t(version), &p)
		})
	})
	if err != nil {
		return nil, err
	}
	r := &Request{ptr: p, model: model}
	// A backstop only: a Request that is dropped unsent is freed eventually.
	runtime.SetFinalizer(r, (*Request).Close)
	return r, nil
}

// Model returns the name of the model the request is for.
func (r *Request) Model() string { return r.model }

// Close releases a request that was never sent. It is a no-op after sending, when
// called again and on nil.
func (r *Request) Close() error {
	if r == nil {
		return nil
	}
	if p := r.take(); p != nil {
		C.infer_request_free(p)
	}
	return nil
}

// take hands the C request over to the caller (the send path), leaving r closed.
func (r *Request) take() *C.infer_request {
	p := r.ptr
	if p != nil {
		r.ptr = nil
		runtime.SetFinalizer(r, nil)
	}
	return p
}

// do runs a fallible call on the live C request.
func (r *Request) do(f func(p *C.infer_request) C.infer_status) error {
	if r.ptr == nil {
		return errRequestUsed
	}
	err := call(func() C.infer_status { return f(r.ptr) })
	runtime.KeepAlive(r)
	return err
}

// AddInput adds an input tensor from raw bytes in the library's layout (host byte
// order, row-major; BYTES elements length-prefixed, see EncodeBytes). For a model that
// batches, shape includes the batch dimension. The bytes are copied.
func (r *Request) AddInput(name string, dt DataType, shape []int64, data []byte) error {
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	return r.addInput(name, dt, shape, p, len(data))
}

func (r *Request) addInput(name string, dt DataType, shape []int64, data unsafe.Pointer, size int) error {
	cname, err := cString("input name", name)
	if err != nil {
		return err
	}
	defer freeCString(cname)
	var cshape *C.int64_t
	if len(shape) > 0 {
		cshape = (*C.int64_t)(unsafe.Pointer(&shape[0]))
	}
	// The library copies data and shape before returning, so passing Go memory (which
	// holds no Go pointers) is within cgo's rules.
	err = r.do(func(p *C.infer_request) C.infer_status {
		return C.infer_request_add_input(p, cname, C.infer_datatype(dt), cshape,
			C.uintptr_t(len(shape)), data, C.uintptr_t(size))
	})
	runtime.KeepAlive(shape)
	return err
}

// AddInputOf adds an input tensor of Go elements, its datatype taken from T.
func AddInputOf[T Element](r *Request, name string, shape []int64, data []T) error {
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	var zero T
	err := r.addInput(name, DataTypeOf[T](), shape, p, len(data)*int(unsafe.Sizeof(zero)))
	runtime.KeepAlive(data)
	return err
}

// AddInputFloat32 adds an FP32 input.
func (r *Request) AddInputFloat32(name string, shape []int64, data []float32) error {
	return AddInputOf(r, name, shape, data)
}

// AddInputFloat64 adds an FP64 input.
func (r *Request) AddInputFloat64(name string, shape []int64, data []float64) error {
	return AddInputOf(r, name, shape, data)
}

// AddInputInt32 adds an INT32 input.
func (r *Request) AddInputInt32(name string, shape []int64, data []int32) error {
	return AddInputOf(r, name, shape, data)
}

// AddInputInt64 adds an INT64 input.
func (r *Request) AddInputInt64(name string, shape []int64, data []int64) error {
	return AddInputOf(r, name, shape, data)
}

// AddInputUint8 adds a UINT8 input.
func (r *Request) AddInputUint8(name string, shape []int64, data []uint8) error {
	return AddInputOf(r, name, shape, data)
}

// AddInputBytes adds a BYTES input, one element per entry of elements.
func (r *Request) AddInputBytes(name string, shape []int64, elements [][]byte) error {
	return r.AddInput(name, TypeBytes, shape, EncodeBytes(elements))
}

// AddInputDevice adds an input that is already in the device memory of GPU deviceID,
// without copying it. ptr is a device address (a CUdeviceptr), not Go memory: it goes
// to the library as an integer and is never read on the host by this package. The
// range [ptr, ptr+byteSize) must lie in one allocation of that device, and the work
// that wrote it must be complete.
//
// The library reads the memory until it releases the input: on a model whose instances
// all run on GPUs after the batch that used it, on any other model once it made a host
// copy when the request was sent, and when a request that is never sent is closed. It
// then calls onRelease once (nil: not told), on a library thread or inside the call that
// released it (Server.Infer, Request.Close, ...), possibly after the FINAL response. The
// caller must keep the memory allocated and unchanged until onRelease runs. Without
// onRelease there is no such signal: keep it until Close of the unsent request returns
// or, once the request is sent, until the Server is closed. onRelease must not block,
// panic or call into the Server.
//
// Unavailable without a usable GPU (also when the server's GPU mode is GPUOff);
// InvalidArgument for a device that does not exist, a range outside one allocation, or
// a BYTES input. When it fails, the memory was not taken and onRelease is never called.
func (r *Request) AddInputDevice(name string, dt DataType, shape []int64, ptr uintptr, byteSize int,
	deviceID int64, onRelease func()) error {
	if byteSize < 0 {
		return newError(InvalidArgument, fmt.Sprintf("input '%s': byte size %d is negative", name, byteSize))
	}
	cname, err := cString("input name", name)
	if err != nil {
		return err
	}
	defer freeCString(cname)
	var cshape *C.int64_t
	if len(shape) > 0 {
		cshape = (*C.int64_t)(unsafe.Pointer(&shape[0]))
	}
	var h cgo.Handle
	if onRelease != nil {
		h = cgo.NewHandle(onRelease)
		liveReleases.Add(1)
	}
	// The device address crosses as a uintptr_t and becomes a pointer only in C
	// (trampolines.c): it is not a Go pointer, so cgo's pointer rules do not apply to it,
	// and Go never holds it as an unsafe.Pointer. The shape is Go memory without Go
	// pointers, copied before the call returns.
	err = r.do(func(p *C.infer_request) C.infer_status {
		return C.goinfer_add_input_device(p, cname, C.infer_datatype(dt), cshape, C.uintptr_t(len(shape)),
			C.uintptr_t(ptr), C.uintptr_t(byteSize), C.int64_t(deviceID), C.uintptr_t(h))
	})
	runtime.KeepAlive(shape)
	if err != nil && onRelease != nil {
		// Refused: the library never calls the release trampoline.
		liveReleases.Add(-1)
		h.Delete()
	}
	return err
}

// SetOutputMemory chooses where the outputs should live (default MemoryCPU, device 0).
// With MemoryGPU, outputs that a GPU instance produces in device memory stay on that
// instance's device, and every other output but BYTES (models on the CPU included) is
// copied to device deviceID before the response is delivered: read them with
// Response.OutputDevice. BYTES outputs stay in host memory, so check
// Response.OutputMemory. MemoryCPUPinned is served as
// MemoryCPU. MemoryGPU is Unavailable without a usable GPU (also when the server's GPU
// mode is GPUOff) and InvalidArgument for a device that does not exist.
func (r *Request) SetOutputMemory(mem MemoryType, deviceID int64) error {
	return r.do(func(p *C.infer_request) C.infer_status {
		return C.infer_request_set_output_memory(p, C.infer_memory_type(mem), C.int64_t(deviceID))
	})
}

// AddRequestedOutput asks for outputs by name; with none requested, the response
// carries every output of the model.
func (r *Request) AddRequestedOutput(names ...string) error {
	for _, name := range names {
		cname, err := cString("output name", name)
		if err != nil {
			return err
		}
		err = r.do(func(p *C.infer_request) C.infer_status {
			return C.infer_request_add_requested_output(p, cname)
		})
		freeCString(cname)
		if err != nil {
			return err
		}
	}
	return nil
}

// SetCorrelationID sets a numeric sequence ID (0 = none).
func (r *Request) SetCorrelationID(id uint64) error {
	return r.do(func(p *C.infer_request) C.infer_status {
		return C.infer_request_set_correlation_id(p, C.uint64_t(id))
	})
}

// SetCorrelationIDString sets a string sequence ID of at most 128 bytes.
func (r *Request) SetCorrelationIDString(id string) error {
	cid, err := cString("correlation ID", id)
	if err != nil {
		return err
	}
	defer freeCString(cid)
	return r.do(func(p *C.infer_request) C.infer_status {
		return C.infer_request_set_correlation_id_str(p, cid)
	})
}

// SetFlags sets the sequence flags (SequenceStart, SequenceEnd).
func (r *Request) SetFlags(flags RequestFlags) error {
	return r.do(func(p *C.infer_request) C.infer_status {
		return C.infer_request_set_flags(p, C.uint32_t(flags))
	})
}

// SetPriority sets the priority level: 0 = the model's default, 1 = highest. It is
// checked against the model's priority_levels when the request is sent.
func (r *Request) SetPriority(level uint32) error {
	return r.do(func(p *C.infer_request) C.infer_status {
		return C.infer_request_set_priority(p, C.uint32_t(level))
	})
}

// SetTimeout sets the queue timeout (0 = none), in whole microseconds rounded up.
func (r *Request) SetTimeout(d time.Duration) error {
	if d < 0 {
		return newError(InvalidArgument, fmt.Sprintf("timeout %v is negative", d))
	}
	us := uint64((d + time.Microsecond - 1) / time.Microsecond)
	return r.do(func(p *C.infer_request) C.infer_status {
		return C.infer_request_set_timeout_us(p, C.uint64_t(us))
	})
}

// SetParameterInt sets an integer request parameter.
func (r *Request) SetParameterInt(key string, v int64) error {
	return r.setParameter(key, func(p *C.infer_request, k *C.char) C.infer_status {
		return C.infer_request_set_parameter_int(p, k, C.int64_t(v))
	})
}

// SetParameterFloat sets a floating-point request parameter.
func (r *Request) SetParameterFloat(key string, v float64) error {
	return r.setParameter(key, func(p *C.infer_request, k *C.char) C.infer_status {
		return C.infer_request_set_parameter_double(p, k, C.double(v))
	})
}

// SetParameterBool sets a boolean request parameter.
func (r *Request) SetParameterBool(key string, v bool) error {
	return r.setParameter(key, func(p *C.infer_request, k *C.char) C.infer_status {
		return C.infer_request_set_parameter_bool(p, k, C.bool(v))
	})
}

// SetParameterString sets a string request parameter.
func (r *Request) SetParameterString(key, v string) error {
	cv, err := cString("parameter value", v)
	if err != nil {
		return err
	}
	defer freeCString(cv)
	return r.setParameter(key, func(p *C.infer_request, k *C.char) C.infer_status {
		return C.infer_request_set_parameter_string(p, k, cv)
	})
}

func (r *Request) setParameter(key string, f func(p *C.infer_request, k *C.char) C.infer_status) error {
	ckey, err := cString("parameter key", key)
	if err != nil {
		return err
	}
	defer freeCString(ckey)
	return r.do(func(p *C.infer_request) C.infer_status { return f(p, ckey) })
}
