package infer

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"libinfer/bindings/go/internal/fakecuda"
)

func TestMemoryTypes(t *testing.T) {
	for _, c := range []struct {
		m    MemoryType
		v    uint32
		name string
	}{{MemoryCPU, 0, "CPU"}, {MemoryCPUPinned, 1, "CPU_PINNED"}, {MemoryGPU, 2, "GPU"}, {MemoryType(9), 9, "MemoryType(9)"}} {
		if uint32(c.m) != c.v || c.m.String() != c.name {
			t.Errorf("%d: %d %q, want %d %q", c.m, uint32(c.m), c.m.String(), c.v, c.name)
		}
	}
	dt := DeviceTensor{Shape: []int64{2, 3}}
	if dt.ElementCount() != 6 {
		t.Errorf("ElementCount = %d", dt.ElementCount())
	}
}

func TestSetOutputMemoryGPUIsUnavailableWithGPUOff(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	req := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{10, 20, 30, 40})
	err := req.SetOutputMemory(MemoryGPU, 0)
	wantCode(t, err, Unavailable, "GPU")
	if !errors.Is(err, ErrUnavailable) {
		t.Errorf("errors.Is(%v, ErrUnavailable) is false", err)
	}
	wantCode(t, req.SetOutputMemory(MemoryGPU, 7), Unavailable)
	wantCode(t, req.SetOutputMemory(MemoryType(9), 0), InvalidArgument)
	// The refused calls leave the request usable; host memory is accepted.
	for _, m := range []MemoryType{MemoryCPUPinned, MemoryCPU} {
		if err := req.SetOutputMemory(m, 0); err != nil {
			t.Fatalf("SetOutputMemory(%v): %v", m, err)
		}
	}
	resp, err := s.Infer(context.Background(), req)
	if err != nil {
		t.Fatalf("Infer: %v", err)
	}
	defer resp.Close()
	sum, _, err := resp.OutputFloat32("OUTPUT0")
	if err != nil || !equalFloats(sum, []float32{11, 22, 33, 44}) {
		t.Errorf("OUTPUT0 = %v, %v", sum, err)
	}
	if err := req.SetOutputMemory(MemoryCPU, 0); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("SetOutputMemory on a sent request: %v", err)
	}
}

func TestAddInputDeviceIsUnavailableWithGPUOff(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	req, err := s.NewRequest("add_sub", LatestVersion)
	if err != nil {
		t.Fatalf("NewRequest: %v", err)
	}
	var released atomic.Int32
	// The address is never read: the call is refused before the library looks at it.
	const fakeDevicePtr = uintptr(0x7f0000001000)
	err = req.AddInputDevice("INPUT0", TypeFP32, []int64{1, 4}, fakeDevicePtr, 16, 0, func() { released.Add(1) })
	wantCode(t, err, Unavailable, "INPUT0", "GPU")
	if !errors.Is(err, ErrUnavailable) {
		t.Errorf("errors.Is(%v, ErrUnavailable) is false", err)
	}
	wantCode(t, req.AddInputDevice("INPUT1", TypeFP32, []int64{1, 4}, fakeDevicePtr, 16, 0, nil), Unavailable)
	wantCode(t, req.AddInputDevice("INPUT0", TypeFP32, []int64{1, 4}, fakeDevicePtr, -1, 0, func() { released.Add(1) }),
		InvalidArgument)
	if n := liveReleases.Load(); n != 0 {
		t.Errorf("%d release functions kept after refused calls", n)
	}
	// The request is still usable.
	if err := req.AddInputFloat32("INPUT0", []int64{1, 4}, []float32{1, 1, 1, 1}); err != nil {
		t.Fatal(err)
	}
	if err := req.AddInputFloat32("INPUT1", []int64{1, 4}, []float32{2, 2, 2, 2}); err != nil {
		t.Fatal(err)
	}
	resp, err := s.Infer(context.Background(), req)
	if err != nil {
		t.Fatalf("Infer: %v", err)
	}
	defer resp.Close()
	if diff, _, err := resp.OutputFloat32("OUTPUT1"); err != nil || !equalFloats(diff, []float32{-1, -1, -1, -1}) {
		t.Errorf("OUTPUT1 = %v, %v", diff, err)
	}
	if n := released.Load(); n != 0 {
		t.Errorf("a refused device input was released %d times", n)
	}
	// A sent request refuses further inputs without taking the release function.
	err = req.AddInputDevice("INPUT0", TypeFP32, []int64{1, 4}, fakeDevicePtr, 16, 0, func() { released.Add(1) })
	if !errors.Is(err, ErrInvalidArgument) || liveReleases.Load() != 0 {
		t.Errorf("AddInputDevice on a sent request: %v, %d live", err, liveReleases.Load())
	}
}

func TestHostOutputsReportCPU(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	resp, err := s.Infer(context.Background(), addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 1, 1, 1}))
	if err != nil {
		t.Fatalf("Infer: %v", err)
	}
	if resp.OutputCount() != 2 {
		t.Fatalf("OutputCount = %d", resp.OutputCount())
	}
	for i := 0; i < resp.OutputCount(); i++ {
		mem, dev, err := resp.OutputMemoryAt(i)
		if err != nil || mem != MemoryCPU || dev != 0 {
			t.Errorf("OutputMemoryAt(%d) = %v %d %v", i, mem, dev, err)
		}
		o, err := resp.OutputAt(i)
		if err != nil {
			t.Fatal(err)
		}
		if mem, dev, err := resp.OutputMemory(o.Name); err != nil || mem != MemoryCPU || dev != 0 {
			t.Errorf("OutputMemory(%s) = %v %d %v", o.Name, mem, dev, err)
		}
		if _, err := resp.OutputDeviceAt(i); CodeOf(err) != InvalidArgument {
			t.Errorf("OutputDeviceAt(%d) of a host output: %v", i, err)
		}
	}
	_, err = resp.OutputDevice("OUTPUT0")
	wantCode(t, err, InvalidArgument, "OUTPUT0", "host memory")
	_, _, err = resp.OutputMemory("NOPE")
	wantCode(t, err, NotFound)
	_, err = resp.OutputDevice("NOPE")
	wantCode(t, err, NotFound)
	for _, err := range []error{
		err3(resp.OutputMemoryAt(2)), err3(resp.OutputMemoryAt(-1)), err3(resp.OutputMemory("")),
		err2(resp.OutputDeviceAt(2)), err2(resp.OutputDevice("")),
	} {
		wantCode(t, err, InvalidArgument)
	}
	resp.Close()
	_, _, err = resp.OutputMemory("OUTPUT0")
	wantCode(t, err, InvalidArgument, "closed")
}

// CloseAfterStream closes like Close (host outputs: nothing is held back, no CUDA).
func TestCloseAfterStream(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	resp, err := s.Infer(context.Background(), addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 1, 1, 1}))
	if err != nil {
		t.Fatalf("Infer: %v", err)
	}
	if err := resp.CloseAfterStream(nil); err != nil {
		t.Fatal(err)
	}
	_, _, err = resp.OutputMemory("OUTPUT0")
	wantCode(t, err, InvalidArgument, "closed")
	if err := resp.CloseAfterStream(nil); err != nil || resp.Close() != nil {
		t.Errorf("closing again: %v", err)
	}
}

// The guard of the copying accessors, on an output as the library describes one in GPU
// memory (no GPU needed: the address is never read).
func TestGPUOutputsAreNotCopiedAsHostMemory(t *testing.T) {
	o := rawOutput{name: "Y", dt: TypeFP32, shape: []int64{1, 4}, mem: MemoryGPU, device: 1,
		ptr: 0x7f0000002000, size: 16}
	_, err := o.tensor()
	wantCode(t, err, InvalidArgument, "'Y'", "GPU 1", "OutputDevice")
	wantCode(t, o.hostOnly(), InvalidArgument, "'Y'", "GPU 1")
	dt, err := o.deviceTensor()
	if err != nil || dt.Name != "Y" || dt.DataType != TypeFP32 || !equalInts(dt.Shape, []int64{1, 4}) ||
		dt.Ptr != 0x7f0000002000 || dt.ByteSize != 16 || dt.DeviceID != 1 {
		t.Errorf("deviceTensor = %+v, %v", dt, err)
	}
	host := rawOutput{name: "X", dt: TypeUint8, shape: []int64{2}, data: []byte{1, 2}, mem: MemoryCPU, size: 2}
	if tensor, err := host.tensor(); err != nil || len(tensor.Data) != 2 {
		t.Errorf("host tensor = %+v, %v", tensor, err)
	}
	if _, err := host.deviceTensor(); CodeOf(err) != InvalidArgument || !strings.Contains(err.Error(), "host memory") {
		t.Errorf("deviceTensor of a host output: %v", err)
	}
}

// Device inputs accepted and released, against the repository's stand-in CUDA driver:
// the test builds it and runs itself again with it on the loader's path (which the
// loader reads only at start) and INFER_FAKE_CUDA=one (one device, GPU 0).
func TestAddInputDeviceWithTheStandInDriver(t *testing.T) {
	if os.Getenv("INFER_FAKE_CUDA") != "one" {
		dir := t.TempDir()
		source, err := filepath.Abs("../../tests/fixtures/fake_libcuda.c")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := exec.LookPath("cc"); err != nil {
			t.Skipf("no C compiler for the stand-in driver: %v", err)
		}
		if err := fakecuda.Build(source, dir); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestAddInputDeviceWithTheStandInDriver$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "INFER_FAKE_CUDA=one", "LD_LIBRARY_PATH="+dir+":"+os.Getenv("LD_LIBRARY_PATH"))
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "stand-in driver: checked") {
			t.Fatalf("child with the stand-in driver: %v\n%s", err, out)
		}
		return
	}

	if standIn, err := fakecuda.Load(); err != nil || !standIn {
		t.Fatalf("libcuda.so.1 is not the stand-in driver: %v", err)
	}
	before := liveReleases.Load()
	s, err := NewServer(&ServerOptions{GPU: GPURequired})
	if err != nil {
		t.Fatalf("NewServer with the stand-in GPU: %v", err)
	}
	defer s.Close()
	if err := s.LoadModel("add_sub", addSubConfig, ""); err != nil {
		t.Fatal(err)
	}
	bytes := make([]byte, 16)
	for i, v := range []float32{1, 2, 3, 4} {
		binary.LittleEndian.PutUint32(bytes[4*i:], math.Float32bits(v))
	}
	dx, err := fakecuda.Upload(bytes)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := fakecuda.Free(dx); err != nil {
			t.Error(err)
		}
	}()

	// add_sub runs on the CPU: the library copies the device input to the host at
	// enqueue and then releases it, on this goroutine's thread or a library thread.
	released := make(chan struct{}, 4)
	release := func() { released <- struct{}{} }
	req, err := s.NewRequest("add_sub", LatestVersion)
	if err != nil {
		t.Fatal(err)
	}
	if err := req.AddInputDevice("INPUT0", TypeFP32, []int64{1, 4}, dx, 16, 0, release); err != nil {
		t.Fatalf("AddInputDevice: %v", err)
	}
	if err := req.AddInputFloat32("INPUT1", []int64{1, 4}, []float32{10, 10, 10, 10}); err != nil {
		t.Fatal(err)
	}
	// GPU outputs asked for: the library copies what the model on the CPU computed to
	// GPU 0 before the callback.
	if err := req.SetOutputMemory(MemoryGPU, 0); err != nil {
		t.Fatalf("SetOutputMemory(GPU, 0): %v", err)
	}
	wantCode(t, req.SetOutputMemory(MemoryGPU, 5), InvalidArgument)
	resp, err := s.Infer(context.Background(), req)
	if err != nil {
		t.Fatalf("Infer: %v", err)
	}
	defer resp.Close()
	if mem, dev, err := resp.OutputMemory("OUTPUT0"); err != nil || mem != MemoryGPU || dev != 0 {
		t.Errorf("OutputMemory = %v %d %v", mem, dev, err)
	}
	_, _, err = resp.OutputFloat32("OUTPUT0")
	wantCode(t, err, InvalidArgument, "OUTPUT0", "GPU 0")
	dt, err := resp.OutputDevice("OUTPUT0")
	if err != nil || dt.DeviceID != 0 || dt.ByteSize != 16 || !equalInts(dt.Shape, []int64{1, 4}) {
		t.Fatalf("OutputDevice = %+v, %v", dt, err)
	}
	got, err := fakecuda.Download(dt.Ptr, dt.ByteSize)
	if err != nil {
		t.Fatal(err)
	}
	sum := make([]float32, 4)
	for i := range sum {
		sum[i] = math.Float32frombits(binary.LittleEndian.Uint32(got[4*i:]))
	}
	if !equalFloats(sum, []float32{11, 12, 13, 14}) {
		t.Errorf("OUTPUT0 on GPU 0 = %v", sum)
	}
	select {
	case <-released:
	case <-time.After(10 * time.Second):
		t.Fatal("the device input was never released")
	}

	// Outside the allocation: refused, never released.
	req2, err := s.NewRequest("add_sub", LatestVersion)
	if err != nil {
		t.Fatal(err)
	}
	err = req2.AddInputDevice("INPUT0", TypeFP32, []int64{1, 4}, dx+8, 16, 0, release)
	wantCode(t, err, InvalidArgument, "INPUT0")
	wantCode(t, req2.AddInputDevice("INPUT0", TypeFP32, []int64{1, 4}, dx, 16, 3, release), InvalidArgument)
	// An unsent request releases its device inputs when closed, within Close.
	if err := req2.AddInputDevice("INPUT0", TypeFP32, []int64{1, 4}, dx, 16, 0, release); err != nil {
		t.Fatal(err)
	}
	req2.Close()
	select {
	case <-released:
	default:
		t.Error("Close of an unsent request did not release its device input")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := liveReleases.Load() - before; n != 0 || len(released) != 0 {
		t.Errorf("%d release functions left, %d extra releases", n, len(released))
	}
	t.Log("stand-in driver: checked")
}

func err3[A, B any](_ A, _ B, err error) error { return err }

func err2[A any](_ A, err error) error { return err }
