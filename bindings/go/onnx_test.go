package infer

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strings"
	"sync"
	"testing"
)

// The shipped repository and onnxruntime's reference outputs for it.
const (
	repository = "../../models"
	fixtures   = "../../tests/fixtures/models"
)

type fixtureTensor struct {
	Name     string    `json:"name"`
	DataType string    `json:"datatype"`
	Shape    []int64   `json:"shape"`
	Data     []float64 `json:"data"`
}

type fixtureCase struct {
	Inputs  []fixtureTensor `json:"inputs"`
	Outputs []fixtureTensor `json:"outputs"`
}

type fixture struct {
	Cases     []fixtureCase `json:"cases"`
	Sequences []struct {
		CorrelationID uint64 `json:"correlation_id"`
		Steps         []struct {
			Start bool `json:"start"`
			End   bool `json:"end"`
			fixtureCase
		} `json:"steps"`
	} `json:"sequences"`
}

func loadFixture(t *testing.T, model string) fixture {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("%s/%s.json", fixtures, model))
	if err != nil {
		t.Fatal(err)
	}
	var f fixture
	if err := json.Unmarshal(raw, &f); err != nil {
		t.Fatalf("%s.json: %v", model, err)
	}
	return f
}

// fp32Request builds a request from FP32 fixture inputs.
func fp32Request(s *Server, model string, inputs []fixtureTensor) (*Request, error) {
	req, err := s.NewRequest(model, LatestVersion)
	if err != nil {
		return nil, err
	}
	for _, in := range inputs {
		if in.DataType != "FP32" {
			req.Close()
			return nil, fmt.Errorf("input %s is %s", in.Name, in.DataType)
		}
		data := make([]float32, len(in.Data))
		for i, v := range in.Data {
			data[i] = float32(v)
		}
		if err := req.AddInputFloat32(in.Name, in.Shape, data); err != nil {
			req.Close()
			return nil, err
		}
	}
	return req, nil
}

// checkFP32 compares a response with the expected FP32 outputs (the tolerance of
// tests/onnx_models.rs).
func checkFP32(resp *Response, want []fixtureTensor) error {
	if resp.OutputCount() != len(want) {
		return fmt.Errorf("%d outputs, want %d", resp.OutputCount(), len(want))
	}
	for _, w := range want {
		got, shape, err := resp.OutputFloat32(w.Name)
		if err != nil {
			return err
		}
		if !equalInts(shape, w.Shape) || len(got) != len(w.Data) {
			return fmt.Errorf("%s: shape %v, want %v", w.Name, shape, w.Shape)
		}
		for i := range got {
			if diff := math.Abs(float64(got[i]) - w.Data[i]); !(diff <= 1e-5+1e-4*math.Abs(w.Data[i])) {
				return fmt.Errorf("%s[%d] = %v, want %v", w.Name, i, got[i], w.Data[i])
			}
		}
	}
	return nil
}

func newRepositoryServer(t *testing.T, startup ...string) *Server {
	t.Helper()
	s, err := NewServer(&ServerOptions{
		ModelRepository: repository, ExplicitModelControl: true, StartupModels: startup, GPU: GPUOff,
	})
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestONNXMLPMatchesTheReference(t *testing.T) {
	s := newRepositoryServer(t, "mlp")
	f := loadFixture(t, "mlp")
	if len(f.Cases) == 0 {
		t.Fatal("no cases")
	}
	// Every case from several goroutines at once, so that the dynamic batcher joins them.
	var wg sync.WaitGroup
	errs := make(chan error, 8*len(f.Cases))
	for g := 0; g < 8; g++ {
		for i, c := range f.Cases {
			wg.Add(1)
			go func(i int, c fixtureCase) {
				defer wg.Done()
				req, err := fp32Request(s, "mlp", c.Inputs)
				if err != nil {
					errs <- err
					return
				}
				resp, err := s.Infer(context.Background(), req)
				if err != nil {
					errs <- fmt.Errorf("case %d: %v", i, err)
					return
				}
				defer resp.Close()
				if err := checkFP32(resp, c.Outputs); err != nil {
					errs <- fmt.Errorf("case %d: %v", i, err)
				}
			}(i, c)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	text, err := s.ModelConfigJSON("mlp", LatestVersion)
	if err != nil || !containsCompact(text, `"max_batch_size":64`) {
		t.Errorf("config: %s %v", text, err)
	}
}

func TestONNXCompletedConfigAndSequence(t *testing.T) {
	s := newRepositoryServer(t)
	if ready, _ := s.ModelReady("cnn", LatestVersion); ready {
		t.Fatal("cnn loaded under explicit control")
	}
	// cnn's config leaves the tensors out; the library completes it from the model.
	if err := s.LoadModel("cnn", "", ""); err != nil {
		t.Fatal(err)
	}
	text, err := s.ModelConfigJSON("cnn", LatestVersion)
	if err != nil || !containsCompact(text, `"name":"PIXELS"`) {
		t.Errorf("completed config: %s %v", text, err)
	}
	f := loadFixture(t, "cnn")
	req, err := fp32Request(s, "cnn", f.Cases[0].Inputs)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := s.Infer(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkFP32(resp, f.Cases[0].Outputs); err != nil {
		t.Error(err)
	}
	resp.Close()

	if err := s.LoadModel("accumulator_onnx", "", ""); err != nil {
		t.Fatal(err)
	}
	acc := loadFixture(t, "accumulator_onnx")
	if len(acc.Sequences) == 0 {
		t.Fatal("no sequences")
	}
	for _, sq := range acc.Sequences {
		seq, err := s.NewSequence(context.Background(), sq.CorrelationID)
		if err != nil {
			t.Fatal(err)
		}
		for i, step := range sq.Steps {
			req, err := fp32Request(s, "accumulator_onnx", step.Inputs)
			if err != nil {
				t.Fatal(err)
			}
			if step.Start != (i == 0) {
				t.Fatalf("sequence %d: step %d has start %v", sq.CorrelationID, i, step.Start)
			}
			if step.End {
				err = seq.End(req)
			} else {
				err = seq.Send(req)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		seq.Close()
		i := 0
		for item := range seq.Responses() {
			if item.Err != nil {
				t.Errorf("sequence %d step %d: %v", sq.CorrelationID, i, item.Err)
			} else if err := checkFP32(item.Response, sq.Steps[i].Outputs); err != nil {
				t.Errorf("sequence %d step %d: %v", sq.CorrelationID, i, err)
			}
			item.Response.Close()
			i++
		}
		if i != len(sq.Steps) {
			t.Errorf("sequence %d: %d responses, want %d", sq.CorrelationID, i, len(sq.Steps))
		}
	}
}

// Where ONNX Runtime cannot be loaded, a server that requires it refuses ONNX models with
// Unavailable naming the file it tried; backend "tract" still serves them.
func TestONNXRuntimeRequiredWhereItCannotLoad(t *testing.T) {
	if os.Getenv("INFER_ONNXRUNTIME_LIBRARY") != "" {
		t.Skip("INFER_ONNXRUNTIME_LIBRARY is set: ONNX Runtime loads here")
	}
	opts := &ServerOptions{
		ModelRepository:      repository,
		ExplicitModelControl: true,
		ONNXRuntimeLibrary:   "/nonexistent/libonnxruntime.so.1.32.0",
		ONNXRuntimeRequired:  true,
	}
	opts.ONNXRuntimeThreads.IntraOp = 1
	s, err := NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	wantCode(t, s.LoadModel("mlp", "", ""), Unavailable, "/nonexistent/libonnxruntime.so.1.32.0")
	raw, err := os.ReadFile(repository + "/mlp/config.pbtxt")
	if err != nil {
		t.Fatal(err)
	}
	config := strings.Replace(string(raw), `platform: "onnxruntime_onnx"`, `backend: "tract"`, 1)
	if err := s.LoadModel("mlp", config, repository+"/mlp"); err != nil {
		t.Fatalf("backend tract: %v", err)
	}
}
