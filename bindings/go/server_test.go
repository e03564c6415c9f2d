package infer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestInferAddSub(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})
	resp, err := s.Infer(context.Background(), addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{10, 20, 30, 40}))
	if err != nil {
		t.Fatalf("Infer: %v", err)
	}
	defer resp.Close()
	sum, shape, err := resp.OutputFloat32("OUTPUT0")
	if err != nil || !equalFloats(sum, []float32{11, 22, 33, 44}) || !equalInts(shape, []int64{1, 4}) {
		t.Errorf("OUTPUT0 = %v %v %v", sum, shape, err)
	}
	diff, _, err := OutputOf[float32](resp, "OUTPUT1")
	if err != nil || !equalFloats(diff, []float32{-9, -18, -27, -36}) {
		t.Errorf("OUTPUT1 = %v %v", diff, err)
	}
	if resp.ModelName() != "add_sub" || resp.ModelVersion() < 1 || resp.RequestID() == 0 || resp.Err() != nil {
		t.Errorf("metadata: %q %d %d %v", resp.ModelName(), resp.ModelVersion(), resp.RequestID(), resp.Err())
	}
	outs, err := resp.Outputs()
	if err != nil || len(outs) != 2 || resp.OutputCount() != 2 {
		t.Fatalf("Outputs = %v, %v", outs, err)
	}
	for _, o := range outs {
		if o.DataType != TypeFP32 || o.ElementCount() != 4 || len(o.Data) != 16 {
			t.Errorf("output %+v", o)
		}
	}
	vals, err := TensorValues[float32](&outs[0])
	if err != nil || len(vals) != 4 {
		t.Errorf("TensorValues = %v, %v", vals, err)
	}
	if _, err := TensorValues[int32](&outs[0]); CodeOf(err) != InvalidArgument {
		t.Errorf("TensorValues with the wrong type: %v", err)
	}
	if _, _, err := resp.OutputInt32("OUTPUT0"); CodeOf(err) != InvalidArgument || !strings.Contains(err.Error(), "FP32") {
		t.Errorf("OutputInt32 of FP32: %v", err)
	}
	if _, err := resp.Output("NOPE"); CodeOf(err) != NotFound {
		t.Errorf("missing output: %v", err)
	}
	if _, err := resp.OutputAt(2); err == nil {
		t.Error("OutputAt past the end succeeded")
	}
}

func TestRequestedOutputsOtherTypesAndBatches(t *testing.T) {
	config := strings.ReplaceAll(addSubConfig, "TYPE_FP32", "TYPE_INT64")
	s := newTestServer(t, map[string]string{"add_sub": config})
	req, err := s.NewRequest("add_sub", LatestVersion)
	if err != nil {
		t.Fatal(err)
	}
	// Two rows in one request.
	shape := []int64{2, 4}
	if err := req.AddInputInt64("INPUT0", shape, []int64{1, 2, 3, 4, 5, 6, 7, 8}); err != nil {
		t.Fatal(err)
	}
	b := []int64{1, 1, 1, 1, 2, 2, 2, 2}
	if err := AddInputOf(req, "INPUT1", shape, b); err != nil {
		t.Fatal(err)
	}
	if err := req.AddRequestedOutput("OUTPUT1"); err != nil {
		t.Fatal(err)
	}
	resp, err := s.Infer(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Close()
	if resp.OutputCount() != 1 {
		t.Errorf("%d outputs, asked for one", resp.OutputCount())
	}
	diff, shape, err := resp.OutputInt64("OUTPUT1")
	if err != nil || !equalInts(diff, []int64{0, 1, 2, 3, 3, 4, 5, 6}) || !equalInts(shape, []int64{2, 4}) {
		t.Errorf("OUTPUT1 = %v %v %v", diff, shape, err)
	}
	if _, err := resp.Output("OUTPUT0"); CodeOf(err) != NotFound {
		t.Errorf("OUTPUT0 was not asked for: %v", err)
	}
}

func TestModelManagement(t *testing.T) {
	s := newTestServer(t, nil)
	if ready, err := s.ModelReady("add_sub", LatestVersion); err != nil || ready {
		t.Errorf("before load: ready %v, %v", ready, err)
	}
	if err := s.LoadModel("add_sub", addSubConfig, ""); err != nil {
		t.Fatal(err)
	}
	if ready, err := s.ModelReady("add_sub", LatestVersion); err != nil || !ready {
		t.Errorf("after load: ready %v, %v", ready, err)
	}
	text, err := s.ModelConfigJSON("add_sub", LatestVersion)
	if err != nil {
		t.Fatal(err)
	}
	var config struct {
		MaxBatchSize int `json:"max_batch_size"`
		Input        []struct {
			Name string `json:"name"`
		} `json:"input"`
	}
	if err := json.Unmarshal([]byte(text), &config); err != nil || config.MaxBatchSize != 8 || len(config.Input) != 2 {
		t.Errorf("config JSON %s: %+v %v", text, config, err)
	}
	for i := 0; i < 3; i++ {
		resp, err := s.Infer(context.Background(), addSubRequest(t, s, []float32{1, 1, 1, 1}, []float32{1, 1, 1, 1}))
		if err != nil {
			t.Fatal(err)
		}
		resp.Close()
	}
	text, err = s.StatisticsJSON("add_sub")
	if err != nil {
		t.Fatal(err)
	}
	var stats struct {
		Models []struct {
			Name           string `json:"name"`
			InferenceCount int    `json:"inference_count"`
			SuccessCount   int    `json:"success_count"`
		} `json:"models"`
	}
	if err := json.Unmarshal([]byte(text), &stats); err != nil || len(stats.Models) != 1 ||
		stats.Models[0].InferenceCount != 3 || stats.Models[0].SuccessCount != 3 {
		t.Errorf("statistics %s: %+v %v", text, stats, err)
	}
	if all, err := s.StatisticsJSON(""); err != nil || !strings.Contains(all, "add_sub") {
		t.Errorf("all statistics: %s %v", all, err)
	}
	if metrics, err := s.MetricsPrometheus(); err != nil || !strings.Contains(metrics, `model="add_sub"`) {
		t.Errorf("metrics: %s %v", metrics, err)
	}
	if err := s.UnloadModel("add_sub"); err != nil {
		t.Fatal(err)
	}
	if ready, _ := s.ModelReady("add_sub", LatestVersion); ready {
		t.Error("ready after unload")
	}
	wantCode(t, s.UnloadModel("add_sub"), NotFound, "add_sub")
	_, err = s.ModelConfigJSON("add_sub", LatestVersion)
	wantCode(t, err, NotFound)
}

func TestErrorsCarryCodesAndMessages(t *testing.T) {
	s := newTestServer(t, map[string]string{"add_sub": addSubConfig})

	err := s.LoadModel("broken", "backend: \"add_sub\"\nmax_batch_size: [", "")
	wantCode(t, err, InvalidArgument, "2:")
	err = s.LoadModel("nobackend", `backend: "no_such_backend"`, "")
	if err == nil {
		t.Error("loading an unknown backend succeeded")
	}
	err = s.LoadModel("add_sub\x00x", addSubConfig, "")
	wantCode(t, err, InvalidArgument, "NUL")

	_, err = s.NewRequest("nope", LatestVersion)
	wantCode(t, err, NotFound, "nope")

	req, err := s.NewRequest("add_sub", LatestVersion)
	if err != nil {
		t.Fatal(err)
	}
	err = req.AddInputFloat32("INPUT0", []int64{1, 3}, []float32{1, 2, 3})
	wantCode(t, err, InvalidArgument, "INPUT0")
	err = req.AddInputFloat32("NOPE", []int64{1, 4}, []float32{1, 2, 3, 4})
	wantCode(t, err, InvalidArgument, "NOPE")
	err = req.AddInputInt32("INPUT0", []int64{1, 4}, []int32{1, 2, 3, 4})
	wantCode(t, err, InvalidArgument, "INPUT0")
	err = req.AddInput("INPUT0", TypeFP32, []int64{1, 4}, make([]byte, 15))
	wantCode(t, err, InvalidArgument)
	err = req.SetTimeout(-time.Second)
	wantCode(t, err, InvalidArgument)
	req.Close()

	// A missing input is found at enqueue.
	req, _ = s.NewRequest("add_sub", LatestVersion)
	if err := req.AddInputFloat32("INPUT0", []int64{1, 4}, []float32{1, 2, 3, 4}); err != nil {
		t.Fatal(err)
	}
	_, err = s.Infer(context.Background(), req)
	wantCode(t, err, InvalidArgument, "INPUT1")

	if err := s.Cancel(987654321); CodeOf(err) != NotFound {
		t.Errorf("Cancel of an unknown id: %v", err)
	}
	var e *Error
	if !errors.As(err, &e) || !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("not an *Error: %#v", err)
	}
}

func TestCloseIsIdempotentEverywhere(t *testing.T) {
	before := liveSinks.Load()
	s, err := NewServer(nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.LoadModel("add_sub", addSubConfig, ""); err != nil {
		t.Fatal(err)
	}
	unsent := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	unsent.Close()
	unsent.Close()
	wantCode(t, unsent.SetPriority(1), InvalidArgument, "closed")
	_, err = s.Infer(context.Background(), unsent)
	wantCode(t, err, InvalidArgument)

	sent := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	resp, err := s.Infer(context.Background(), sent)
	if err != nil {
		t.Fatal(err)
	}
	sent.Close() // consumed: a no-op
	wantCode(t, sent.AddRequestedOutput("OUTPUT0"), InvalidArgument)
	resp.Close()
	resp.Close()
	if _, _, err := resp.OutputFloat32("OUTPUT0"); CodeOf(err) != InvalidArgument {
		t.Errorf("output of a closed response: %v", err)
	}
	if resp.Err() == nil || resp.OutputCount() != 0 || resp.RequestID() != 0 {
		t.Error("a closed response still answers")
	}

	pending := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	if err := s.Shutdown(time.Second); err != nil {
		t.Fatal(err)
	}
	if err := s.Shutdown(time.Second); err != nil {
		t.Errorf("second Shutdown: %v", err)
	}
	_, err = s.Infer(context.Background(), pending)
	wantCode(t, err, Unavailable)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	_, err = s.NewRequest("add_sub", LatestVersion)
	wantCode(t, err, Unavailable, "closed")
	wantCode(t, s.LoadModel("x", addSubConfig, ""), Unavailable)
	if _, err := s.StatisticsJSON(""); CodeOf(err) != Unavailable {
		t.Errorf("statistics of a closed server: %v", err)
	}
	if n := liveSinks.Load(); n != before {
		t.Errorf("live sinks %d, before %d", n, before)
	}
}

func TestPausedModelTimesOutAndPriority(t *testing.T) {
	config := addSubConfig + `
  dynamic_batching { priority_levels: 2 default_priority_level: 2 }`
	config = strings.Replace(config, "dynamic_batching { max_queue_delay_microseconds: 500 }", "", 1)
	s := newTestServer(t, map[string]string{"add_sub": config})
	if err := s.PauseModel("add_sub"); err != nil {
		t.Fatal(err)
	}
	req := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	if err := req.SetTimeout(20 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	_, err := s.Infer(context.Background(), req)
	wantCode(t, err, DeadlineExceeded)

	// Paused: both wait; after resume both are answered.
	type result struct {
		resp *Response
		err  error
	}
	results := make(chan result, 2)
	for _, level := range []uint32{2, 1} {
		req := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
		if err := req.SetPriority(level); err != nil {
			t.Fatal(err)
		}
		go func() {
			resp, err := s.Infer(context.Background(), req)
			results <- result{resp, err}
		}()
	}
	time.Sleep(20 * time.Millisecond)
	if err := s.ResumeModel("add_sub"); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		r := <-results
		if r.err != nil {
			t.Errorf("after resume: %v", r.err)
			continue
		}
		r.resp.Close()
	}
	req = addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	if err := req.SetPriority(3); err != nil {
		t.Fatal(err)
	}
	_, err = s.Infer(context.Background(), req)
	wantCode(t, err, InvalidArgument)
}

func TestParametersAndLog(t *testing.T) {
	var mu sync.Mutex
	var messages []string
	s, err := NewServer(&ServerOptions{
		GPU:      GPUOff,
		LogLevel: LogDebug,
		Log: func(level LogLevel, message string) {
			mu.Lock()
			messages = append(messages, fmt.Sprintf("%d %s", level, message))
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.LoadModel("add_sub", addSubConfig, ""); err != nil {
		t.Fatal(err)
	}
	req := addSubRequest(t, s, []float32{1, 2, 3, 4}, []float32{1, 2, 3, 4})
	for _, err := range []error{
		req.SetParameterInt("i", 7), req.SetParameterFloat("f", 0.5),
		req.SetParameterBool("b", true), req.SetParameterString("s", "text"),
		req.SetCorrelationID(0),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	resp, err := s.Infer(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := resp.ParameterInt("no_such_parameter"); CodeOf(err) != NotFound {
		t.Errorf("missing parameter: %v", err)
	}
	if _, err := resp.ParameterString("no_such_parameter"); CodeOf(err) != NotFound {
		t.Errorf("missing parameter: %v", err)
	}
	resp.Close()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(messages) == 0 {
		t.Error("no log message at debug level")
	}
}

func TestRepositoryErrors(t *testing.T) {
	_, err := NewServer(&ServerOptions{ModelRepository: "/no/such/folder", GPU: GPUOff})
	if err == nil {
		t.Fatal("a missing repository was accepted")
	}
	_, err = NewServer(&ServerOptions{
		ModelRepository: "../../models", ExplicitModelControl: true,
		StartupModels: []string{"no_such_model"}, GPU: GPUOff,
	})
	if err == nil || !strings.Contains(err.Error(), "no_such_model") {
		t.Fatalf("unknown startup model: %v", err)
	}
}

// Close while goroutines keep sending: each call either succeeds or fails with
// Unavailable, and every accepted request still gets its FINAL.
func TestCloseWhileSending(t *testing.T) {
	before := liveSinks.Load()
	s, err := NewServer(&ServerOptions{GPU: GPUOff})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.LoadModel("add_sub", addSubConfig, ""); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				req, err := s.NewRequest("add_sub", LatestVersion)
				if err == nil {
					err = req.AddInputFloat32("INPUT0", []int64{1, 4}, []float32{1, 2, 3, 4})
					if err == nil {
						err = req.AddInputFloat32("INPUT1", []int64{1, 4}, []float32{1, 2, 3, 4})
					}
					if err == nil {
						var resp *Response
						resp, err = s.Infer(context.Background(), req)
						resp.Close()
					}
					req.Close()
				}
				if err != nil {
					if CodeOf(err) != Unavailable {
						errs <- err
					}
					return
				}
			}
		}()
	}
	time.Sleep(30 * time.Millisecond)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("a call failed with other than Unavailable: %v", err)
	}
	if n := liveSinks.Load(); n != before {
		t.Errorf("%d requests without their FINAL", n-before)
	}
}

// The repository as Triton's users know it: a poll period that finds a new folder, the
// index with each model's state, and a model loaded from files in memory.
func TestRepositoryPollIndexAndFilesInMemory(t *testing.T) {
	repo := t.TempDir()
	write := func(name string) {
		if err := os.MkdirAll(filepath.Join(repo, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(repo, name, "config.pbtxt"), []byte(addSubConfig), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a")
	s, err := NewServer(&ServerOptions{ModelRepository: repo, RepositoryPoll: 20 * time.Millisecond, GPU: GPUOff})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	write("b")
	for deadline := time.Now().Add(20 * time.Second); ; {
		if ready, _ := s.ModelReady("b", LatestVersion); ready {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the poll period did not load the new folder 'b'")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := s.PollRepository(); err != nil {
		t.Fatal(err)
	}
	onnx, err := os.ReadFile("../../models/add_sub/1/model.onnx")
	if err != nil {
		t.Fatal(err)
	}
	err = s.LoadModelFiles("mem", `platform: "onnxruntime_onnx" max_batch_size: 8`,
		map[string][]byte{"file:1/model.onnx": onnx})
	if err != nil {
		t.Fatal(err)
	}
	text, err := s.RepositoryIndexJSON(false)
	if err != nil {
		t.Fatal(err)
	}
	var index []struct {
		Name    string `json:"name"`
		Version string `json:"version"`
		State   string `json:"state"`
	}
	if err := json.Unmarshal([]byte(text), &index); err != nil {
		t.Fatalf("index %s: %v", text, err)
	}
	got := []string{}
	for _, e := range index {
		got = append(got, e.Name+"/"+e.Version+"/"+e.State)
	}
	if want := "a/1/READY b/1/READY mem/1/READY"; strings.Join(got, " ") != want {
		t.Errorf("index %s: got %v, want %s", text, got, want)
	}
	wantCode(t, s.LoadModelFiles("bad", addSubConfig, map[string][]byte{"../x": {1}}), InvalidArgument, "'../x'")
}

func TestRateLimiterSerializesModelsSharingAResource(t *testing.T) {
	s, err := NewServer(&ServerOptions{GPU: GPUOff, RateLimit: true,
		RateLimitResources: []RateLimitResource{{Name: "R", Count: 1, Device: -1}}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	limited := func(name string, need int) string {
		return fmt.Sprintf(`name: "%s" backend: "identity" max_batch_size: 0
  input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
  output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
  instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R" global: true count: %d } ] } } ]
  parameters { key: "execute_delay_us" value { string_value: "100000" } }`, name, need)
	}
	wantCode(t, s.LoadModel("big", limited("big", 2), ""), InvalidArgument, "needs 2, but the server gives it 1")
	for _, m := range []string{"a", "b"} {
		if err := s.LoadModel(m, limited(m, 1), ""); err != nil {
			t.Fatal(err)
		}
	}
	// Two 100 ms executions that share R's one unit take turns.
	start := time.Now()
	var wg sync.WaitGroup
	for _, m := range []string{"a", "b"} {
		wg.Add(1)
		go func(m string) {
			defer wg.Done()
			req, err := s.NewRequest(m, LatestVersion)
			if err != nil {
				t.Error(err)
				return
			}
			if err := req.AddInputInt32("IN", []int64{1}, []int32{1}); err != nil {
				t.Error(err)
				return
			}
			resp, err := s.Infer(context.Background(), req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Close()
		}(m)
	}
	wg.Wait()
	if elapsed := time.Since(start); elapsed < 190*time.Millisecond {
		t.Fatalf("the two executions overlapped: both done in %v", elapsed)
	}
}
