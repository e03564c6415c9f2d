package infer

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

// Configs of built-in models (no model files needed).
const (
	addSubConfig = `backend: "add_sub" max_batch_size: 8
  input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
          { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
  output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
           { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
  dynamic_batching { max_queue_delay_microseconds: 500 }
  instance_group [ { count: 2 kind: KIND_CPU } ]`

	// One instance that takes 1 s per execution, so a second request waits queued.
	slowConfig = `backend: "identity" max_batch_size: 0
  input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
  output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
  instance_group [ { count: 1 kind: KIND_CPU } ]
  parameters { key: "execute_delay_us" value { string_value: "1000000" } }`

	// Implicit-state running sum; 1 instance x 4 slots, so more streams wait in the backlog.
	accumulatorConfig = `backend: "accumulator" max_batch_size: 4
  input [ { name: "INPUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
  output [ { name: "OUTPUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
  instance_group [ { count: 1 kind: KIND_CPU } ]
  parameters { key: "execute_delay_us" value { string_value: "200" } }
  sequence_batching {
    max_sequence_idle_microseconds: 5000000
    direct { }
    state [ { input_name: "SUM_IN" output_name: "SUM_OUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
  }`
)

// newTestServer makes a server with the given built-in models loaded (name -> config).
// Cleanup closes it and checks that every request sent got its FINAL and that no
// goroutine was left behind.
func newTestServer(t *testing.T, models map[string]string) *Server {
	t.Helper()
	before := runtime.NumGoroutine()
	s, err := NewServer(&ServerOptions{GPU: GPUOff})
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		checkNothingLeft(t, before)
	})
	for name, config := range models {
		if err := s.LoadModel(name, config, ""); err != nil {
			t.Fatalf("LoadModel(%s): %v", name, err)
		}
	}
	return s
}

// checkNothingLeft checks, after the server was closed (which drains), that no request
// waits for its FINAL, every device input was released and the goroutine count is back
// to before.
func checkNothingLeft(t *testing.T, goroutinesBefore int) {
	t.Helper()
	if n := liveSinks.Load(); n != 0 {
		t.Errorf("%d requests still wait for their FINAL after Close", n)
	}
	if n := liveReleases.Load(); n != 0 {
		t.Errorf("%d device inputs were never released after Close", n)
	}
	deadline := time.Now().Add(2 * time.Second)
	for runtime.NumGoroutine() > goroutinesBefore && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > goroutinesBefore {
		buf := make([]byte, 1<<16)
		buf = buf[:runtime.Stack(buf, true)]
		t.Errorf("%d goroutines before, %d after:\n%s", goroutinesBefore, n, buf)
	}
}

// addSubRequest builds a request for add_sub with one row.
func addSubRequest(t *testing.T, s *Server, a, b []float32) *Request {
	t.Helper()
	req, err := s.NewRequest("add_sub", LatestVersion)
	if err != nil {
		t.Fatalf("NewRequest: %v", err)
	}
	shape := []int64{1, int64(len(a))}
	if err := req.AddInputFloat32("INPUT0", shape, a); err != nil {
		t.Fatalf("AddInput INPUT0: %v", err)
	}
	if err := req.AddInputFloat32("INPUT1", shape, b); err != nil {
		t.Fatalf("AddInput INPUT1: %v", err)
	}
	return req
}

// slowRequest builds a request for the slow identity model.
func slowRequest(t *testing.T, s *Server, v int32) *Request {
	t.Helper()
	req, err := s.NewRequest("slow", LatestVersion)
	if err != nil {
		t.Fatalf("NewRequest: %v", err)
	}
	if err := req.AddInputInt32("IN", []int64{1}, []int32{v}); err != nil {
		t.Fatalf("AddInput: %v", err)
	}
	return req
}

// wantCode fails unless err is an *Error with code whose message mentions each of words.
func wantCode(t *testing.T, err error, code Code, words ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %v", code)
	}
	if got := CodeOf(err); got != code {
		t.Fatalf("got %v (%v), want %v", got, err, code)
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not mention %q", err, w)
		}
	}
}

func equalFloats(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func equalInts(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
