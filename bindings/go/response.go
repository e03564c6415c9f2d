package infer

/*
#include <stdlib.h>
#include <string.h>
#include "infer.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// Response is one response of a request: its status, its outputs and where it came
// from. Output data is copied out into Go memory, so what the accessors return stays
// valid after Close. Outputs in GPU memory (see Request.SetOutputMemory) are never
// copied or read on the host: the copying accessors refuse them, and OutputDevice gives
// their device address, which is valid only until Close. Close releases the library's memory; it is idempotent and may be
// called from any goroutine, but not while another goroutine still reads the Response.
type Response struct {
	mu  sync.RWMutex
	ptr *C.infer_response
}

func newResponse(p *C.infer_response) *Response {
	r := &Response{ptr: p}
	// A backstop only: dropping a Response without Close leaks nothing for long.
	runtime.SetFinalizer(r, (*Response).Close)
	return r
}

// Close releases the response. Calling it again, or on nil, does nothing.
func (r *Response) Close() error {
	if p := r.take(); p != nil {
		C.infer_response_free(p)
	}
	return nil
}

// take detaches the C response (nil if closed already, or r is nil) for freeing.
func (r *Response) take() *C.infer_response {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	p := r.ptr
	r.ptr = nil
	r.mu.Unlock()
	if p != nil {
		runtime.SetFinalizer(r, nil)
	}
	return p
}

// CloseAfterStream releases the response as Close does, keeping its outputs in GPU
// memory from being reused until the work queued so far on stream (a cudaStream_t of
// their GPU) has run: for reads of them queued on a non-blocking stream and not waited
// for (infer_response_free_after_stream).
func (r *Response) CloseAfterStream(stream unsafe.Pointer) error {
	if p := r.take(); p != nil {
		C.infer_response_free_after_stream(p, stream)
	}
	return nil
}

// read runs f on the live C response; it reports whether the response was still open.
func (r *Response) read(f func(p *C.infer_response)) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.ptr == nil {
		return false
	}
	f(r.ptr)
	return true
}

// Err returns nil when the request succeeded, else an *Error with the status the
// request ended with and its message.
func (r *Response) Err() error {
	var err error
	if !r.read(func(p *C.infer_response) {
		if st := C.infer_response_status(p); st != C.INFER_STATUS_OK {
			err = newError(Code(st), C.GoString(C.infer_response_error_message(p)))
		}
	}) {
		return errResponseClosed
	}
	return err
}

// RequestID returns the id the library gave the request (0 once closed).
func (r *Response) RequestID() uint64 {
	var id uint64
	r.read(func(p *C.infer_response) { id = uint64(C.infer_response_request_id(p)) })
	return id
}

// ModelName returns the model that answered ("" once closed).
func (r *Response) ModelName() string {
	var name string
	r.read(func(p *C.infer_response) { name = C.GoString(C.infer_response_model_name(p)) })
	return name
}

// ModelVersion returns the version of the model that answered.
func (r *Response) ModelVersion() int64 {
	var v int64
	r.read(func(p *C.infer_response) { v = int64(C.infer_response_model_version(p)) })
	return v
}

// CorrelationID returns the request's numeric sequence ID (0 for none or a string ID).
func (r *Response) CorrelationID() uint64 {
	var id uint64
	r.read(func(p *C.infer_response) { id = uint64(C.infer_response_correlation_id(p)) })
	return id
}

// OutputCount returns the number of outputs (0 for an error response).
func (r *Response) OutputCount() int {
	var n int
	r.read(func(p *C.infer_response) { n = int(C.infer_response_output_count(p)) })
	return n
}

// Tensor is an output copied into Go memory.
type Tensor struct {
	Name     string
	DataType DataType
	Shape    []int64 // for a model that batches, dim 0 is this request's batch size
	Data     []byte  // host byte order, row-major; BYTES elements length-prefixed
}

// ElementCount returns the number of elements the shape describes.
func (t *Tensor) ElementCount() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// TensorValues returns a tensor's elements as []T (a copy); T must match its datatype.
func TensorValues[T Element](t *Tensor) ([]T, error) {
	if want := DataTypeOf[T](); t.DataType != want {
		return nil, newError(InvalidArgument, fmt.Sprintf(
			"output '%s' is %s, not %s", t.Name, t.DataType, want))
	}
	return elementsFrom[T](t.Data)
}

// rawOutput describes an output in the response's memory, valid while the read lock
// that produced it is held. data is set only for outputs in host memory; ptr is the
// address (a device address for MemoryGPU) and size the byte size either way.
type rawOutput struct {
	name   string
	dt     DataType
	shape  []int64
	data   []byte
	mem    MemoryType
	device int64
	ptr    uintptr
	size   int
}

// withOutput finds output name (or index when name is "") and runs f on it under the
// read lock.
func (r *Response) withOutput(name string, index int, f func(o rawOutput) error) error {
	var cname *C.char
	if name != "" {
		var err error
		if cname, err = cString("output name", name); err != nil {
			return err
		}
		defer freeCString(cname)
	}
	var err error
	open := r.read(func(p *C.infer_response) {
		var (
			oname *C.char
			dt    C.infer_datatype
			shape *C.int64_t
			ndim  C.uintptr_t
			data  unsafe.Pointer
			size  C.uintptr_t
			mem   C.infer_memory_type
			dev   C.int64_t
		)
		err = call(func() C.infer_status {
			if cname != nil {
				return C.infer_response_output_by_name(p, cname, &dt, &shape, &ndim, &data, &size)
			}
			return C.infer_response_output(p, C.uintptr_t(index), &oname, &dt, &shape, &ndim, &data, &size)
		})
		if err != nil {
			return
		}
		if cname != nil {
			if index = outputIndex(p, cname); index < 0 {
				err = newError(Internal, fmt.Sprintf("output '%s' has no index", name))
				return
			}
		}
		err = call(func() C.infer_status {
			return C.infer_response_output_memory(p, C.uintptr_t(index), &mem, &dev)
		})
		if err != nil {
			return
		}
		o := rawOutput{name: name, dt: DataType(dt), shape: make([]int64, int(ndim)),
			mem: MemoryType(mem), device: int64(dev), ptr: uintptr(data), size: int(size)}
		if cname == nil {
			o.name = C.GoString(oname)
		}
		if ndim > 0 {
			copy(o.shape, unsafe.Slice((*int64)(unsafe.Pointer(shape)), int(ndim)))
		}
		// A device address never becomes a Go slice.
		if size > 0 && o.onHost() {
			o.data = unsafe.Slice((*byte)(data), int(size))
		}
		err = f(o)
	})
	if !open {
		return errResponseClosed
	}
	return err
}

// outputIndex returns the index of the output called name, or -1.
func outputIndex(p *C.infer_response, name *C.char) int {
	n := int(C.infer_response_output_count(p))
	for i := 0; i < n; i++ {
		var oname *C.char
		if C.infer_response_output(p, C.uintptr_t(i), &oname, nil, nil, nil, nil, nil) == C.INFER_STATUS_OK &&
			oname != nil && C.strcmp(oname, name) == 0 {
			return i
		}
	}
	return -1
}

func (o rawOutput) onHost() bool { return o.mem != MemoryGPU }

// hostOnly refuses an output in GPU memory to the accessors that copy bytes to Go.
func (o rawOutput) hostOnly() error {
	if o.onHost() {
		return nil
	}
	return newError(InvalidArgument, fmt.Sprintf(
		"output '%s' is in the memory of GPU %d, not in host memory: read it with "+
			"Response.OutputDevice, or ask for host outputs with Request.SetOutputMemory(MemoryCPU, 0)",
		o.name, o.device))
}

func (o rawOutput) tensor() (Tensor, error) {
	if err := o.hostOnly(); err != nil {
		return Tensor{}, err
	}
	return Tensor{Name: o.name, DataType: o.dt, Shape: o.shape, Data: append([]byte(nil), o.data...)}, nil
}

func (o rawOutput) deviceTensor() (DeviceTensor, error) {
	if o.onHost() {
		return DeviceTensor{}, newError(InvalidArgument, fmt.Sprintf(
			"output '%s' is in host memory, not in GPU memory: read it with Response.Output", o.name))
	}
	return DeviceTensor{Name: o.name, DataType: o.dt, Shape: o.shape, Ptr: o.ptr, ByteSize: o.size,
		DeviceID: o.device}, nil
}

// OutputMemory returns where the output called name lives: MemoryCPU and device 0, or
// MemoryGPU and the GPU's id (NotFound if the response has no such output).
func (r *Response) OutputMemory(name string) (MemoryType, int64, error) {
	if name == "" {
		return 0, 0, newError(InvalidArgument, "output name is empty")
	}
	var o rawOutput
	err := r.withOutput(name, 0, func(raw rawOutput) error { o = raw; return nil })
	if err != nil {
		return 0, 0, err
	}
	return o.mem, o.device, nil
}

// OutputMemoryAt returns where output index (0-based, below OutputCount) lives.
func (r *Response) OutputMemoryAt(index int) (MemoryType, int64, error) {
	if index < 0 {
		return 0, 0, newError(InvalidArgument, fmt.Sprintf("output index %d is negative", index))
	}
	var o rawOutput
	err := r.withOutput("", index, func(raw rawOutput) error { o = raw; return nil })
	if err != nil {
		return 0, 0, err
	}
	return o.mem, o.device, nil
}

// OutputDevice returns the output called name when it is in GPU memory: its device
// address, byte size and GPU (valid until Close; see DeviceTensor). InvalidArgument for
// an output in host memory (read those with Output), NotFound if there is none.
func (r *Response) OutputDevice(name string) (DeviceTensor, error) {
	if name == "" {
		return DeviceTensor{}, newError(InvalidArgument, "output name is empty")
	}
	var t DeviceTensor
	err := r.withOutput(name, 0, func(o rawOutput) (err error) { t, err = o.deviceTensor(); return err })
	return t, err
}

// OutputDeviceAt returns output index (0-based) when it is in GPU memory.
func (r *Response) OutputDeviceAt(index int) (DeviceTensor, error) {
	if index < 0 {
		return DeviceTensor{}, newError(InvalidArgument, fmt.Sprintf("output index %d is negative", index))
	}
	var t DeviceTensor
	err := r.withOutput("", index, func(o rawOutput) (err error) { t, err = o.deviceTensor(); return err })
	return t, err
}

// Output returns a copy of the output called name (NotFound if the response has none;
// InvalidArgument if it is in GPU memory, see OutputDevice).
func (r *Response) Output(name string) (Tensor, error) {
	if name == "" {
		return Tensor{}, newError(InvalidArgument, "output name is empty")
	}
	var t Tensor
	err := r.withOutput(name, 0, func(o rawOutput) (err error) { t, err = o.tensor(); return err })
	return t, err
}

// OutputAt returns a copy of output index (0-based, below OutputCount); InvalidArgument
// if it is in GPU memory.
func (r *Response) OutputAt(index int) (Tensor, error) {
	if index < 0 {
		return Tensor{}, newError(InvalidArgument, fmt.Sprintf("output index %d is negative", index))
	}
	var t Tensor
	err := r.withOutput("", index, func(o rawOutput) (err error) { t, err = o.tensor(); return err })
	return t, err
}

// Outputs returns copies of every output, in the response's order; InvalidArgument if
// one is in GPU memory.
func (r *Response) Outputs() ([]Tensor, error) {
	n := r.OutputCount()
	out := make([]Tensor, 0, n)
	for i := 0; i < n; i++ {
		t, err := r.OutputAt(i)
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

// OutputOf returns output name as Go elements (a copy) and its shape; T must match the
// output's datatype, and the output must be in host memory.
func OutputOf[T Element](r *Response, name string) ([]T, []int64, error) {
	if name == "" {
		return nil, nil, newError(InvalidArgument, "output name is empty")
	}
	var (
		values []T
		shape  []int64
	)
	err := r.withOutput(name, 0, func(o rawOutput) error {
		if err := o.hostOnly(); err != nil {
			return err
		}
		if want := DataTypeOf[T](); o.dt != want {
			return newError(InvalidArgument, fmt.Sprintf("output '%s' is %s, not %s", name, o.dt, want))
		}
		var err error
		values, err = elementsFrom[T](o.data)
		shape = o.shape
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	return values, shape, nil
}

// OutputFloat32 returns an FP32 output and its shape.
func (r *Response) OutputFloat32(name string) ([]float32, []int64, error) {
	return OutputOf[float32](r, name)
}

// OutputFloat64 returns an FP64 output and its shape.
func (r *Response) OutputFloat64(name string) ([]float64, []int64, error) {
	return OutputOf[float64](r, name)
}

// OutputInt32 returns an INT32 output and its shape.
func (r *Response) OutputInt32(name string) ([]int32, []int64, error) {
	return OutputOf[int32](r, name)
}

// OutputInt64 returns an INT64 output and its shape.
func (r *Response) OutputInt64(name string) ([]int64, []int64, error) {
	return OutputOf[int64](r, name)
}

// OutputBytes returns the elements of a BYTES output and its shape.
func (r *Response) OutputBytes(name string) ([][]byte, []int64, error) {
	t, err := r.Output(name)
	if err != nil {
		return nil, nil, err
	}
	if t.DataType != TypeBytes {
		return nil, nil, newError(InvalidArgument, fmt.Sprintf("output '%s' is %s, not BYTES", name, t.DataType))
	}
	elements, err := DecodeBytes(t.Data)
	if err != nil {
		return nil, nil, err
	}
	return elements, t.Shape, nil
}

// ParameterInt reads an integer response parameter (NotFound if absent).
func (r *Response) ParameterInt(key string) (int64, error) {
	ckey, err := cString("parameter key", key)
	if err != nil {
		return 0, err
	}
	defer freeCString(ckey)
	var v C.int64_t
	if !r.read(func(p *C.infer_response) {
		err = call(func() C.infer_status { return C.infer_response_parameter_int(p, ckey, &v) })
	}) {
		return 0, errResponseClosed
	}
	return int64(v), err
}

// ParameterString reads a string response parameter (NotFound if absent).
func (r *Response) ParameterString(key string) (string, error) {
	ckey, err := cString("parameter key", key)
	if err != nil {
		return "", err
	}
	defer freeCString(ckey)
	var s string
	if !r.read(func(p *C.infer_response) {
		var v *C.char
		err = call(func() C.infer_status { return C.infer_response_parameter_string(p, ckey, &v) })
		if err == nil {
			s = C.GoString(v)
		}
	}) {
		return "", errResponseClosed
	}
	return s, err
}
