// Command example runs libinfer from Go: the built-in add_sub model from many
// goroutines, a stateful accumulator sequence on a channel, and the ONNX model mlp of the
// shipped repository when it is found.
//
//	cd bindings/go && go run ./cmd/example [-models ../../models]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"sync"
	"time"

	infer "libinfer/bindings/go"
)

const addSubConfig = `backend: "add_sub" max_batch_size: 8
  input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
          { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
  output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
           { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
  dynamic_batching { max_queue_delay_microseconds: 1000 }`

const accumulatorConfig = `backend: "accumulator" max_batch_size: 4
  input [ { name: "INPUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
  output [ { name: "OUTPUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
  sequence_batching {
    direct { }
    state [ { input_name: "SUM_IN" output_name: "SUM_OUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
  }`

func main() {
	models := flag.String("models", filepath.Join("..", "..", "models"), "model repository with mlp (skipped when missing)")
	flag.Parse()
	if err := run(*models); err != nil {
		log.Fatal(err)
	}
}

func run(models string) error {
	major, minor := infer.APIVersion()
	fmt.Printf("libinfer %s, C API %d.%d\n", infer.Version(), major, minor)

	opts := &infer.ServerOptions{GPU: infer.GPUOff}
	if _, err := os.Stat(filepath.Join(models, "mlp", "config.pbtxt")); err == nil {
		opts.ModelRepository = models
		opts.ExplicitModelControl = true
		opts.StartupModels = []string{"mlp"}
	}
	server, err := infer.NewServer(opts)
	if err != nil {
		return err
	}
	defer server.Close()
	if err := server.LoadModel("add_sub", addSubConfig, ""); err != nil {
		return err
	}
	if err := server.LoadModel("accumulator", accumulatorConfig, ""); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	if err := addSub(ctx, server); err != nil {
		return err
	}
	if err := accumulate(ctx, server); err != nil {
		return err
	}
	if opts.ModelRepository != "" {
		if err := classify(ctx, server); err != nil {
			return err
		}
	} else {
		fmt.Printf("mlp: no repository at %s, skipped\n", models)
	}

	// An error carries its code.
	_, err = server.NewRequest("no_such_model", infer.LatestVersion)
	var e *infer.Error
	if errors.As(err, &e) {
		fmt.Printf("unknown model: code %v, errors.Is(err, infer.ErrNotFound) = %v\n",
			e.Code(), errors.Is(err, infer.ErrNotFound))
	}
	stats, err := server.StatisticsJSON("add_sub")
	if err != nil {
		return err
	}
	fmt.Printf("add_sub statistics: %s\n", stats)
	return nil
}

// addSub sends 64 requests from 8 goroutines; the dynamic batcher joins them.
func addSub(ctx context.Context, server *infer.Server) error {
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 8; i++ {
				x := float32(g*10 + i)
				a, b := []float32{x, x, x, x}, []float32{1, 2, 3, 4}
				req, err := server.NewRequest("add_sub", infer.LatestVersion)
				if err == nil {
					err = req.AddInputFloat32("INPUT0", []int64{1, 4}, a)
				}
				if err == nil {
					err = req.AddInputFloat32("INPUT1", []int64{1, 4}, b)
				}
				if err != nil {
					req.Close()
					errs <- err
					return
				}
				resp, err := server.Infer(ctx, req)
				if err != nil {
					errs <- err
					return
				}
				sum, _, err := resp.OutputFloat32("OUTPUT0")
				resp.Close()
				if err != nil {
					errs <- err
					return
				}
				if g == 0 && i == 0 {
					fmt.Printf("add_sub: %v + %v = %v\n", a, b, sum)
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return err
	}
	fmt.Println("add_sub: 64 requests from 8 goroutines answered")
	return nil
}

// accumulate runs one sequence: the running sum of the values sent.
func accumulate(ctx context.Context, server *infer.Server) error {
	seq, err := server.NewSequence(ctx, 42)
	if err != nil {
		return err
	}
	values := []int64{5, 7, -2, 10}
	for i, v := range values {
		req, err := server.NewRequest("accumulator", infer.LatestVersion)
		if err != nil {
			seq.Close()
			return err
		}
		if err := req.AddInputInt64("INPUT", []int64{1, 1}, []int64{v}); err != nil {
			req.Close()
			seq.Close()
			return err
		}
		if i == len(values)-1 {
			err = seq.End(req)
		} else {
			err = seq.Send(req)
		}
		if err != nil {
			seq.Close()
			return err
		}
	}
	var sums []int64
	for item := range seq.Responses() {
		if item.Err != nil {
			item.Response.Close()
			return item.Err
		}
		out, _, err := item.Response.OutputInt64("OUTPUT")
		item.Response.Close()
		if err != nil {
			return err
		}
		sums = append(sums, out[0])
	}
	fmt.Printf("accumulator (sequence 42): inputs %v, running sums %v\n", values, sums)
	return nil
}

// classify runs the ONNX model mlp on one feature vector.
func classify(ctx context.Context, server *infer.Server) error {
	features := make([]float32, 64)
	for i := range features {
		features[i] = float32(i%7) / 7
	}
	req, err := server.NewRequest("mlp", infer.LatestVersion)
	if err != nil {
		return err
	}
	if err := req.AddInputFloat32("FEATURES", []int64{1, 64}, features); err != nil {
		req.Close()
		return err
	}
	resp, err := server.Infer(ctx, req)
	if err != nil {
		return err
	}
	defer resp.Close()
	logits, shape, err := resp.OutputFloat32("LOGITS")
	if err != nil {
		return err
	}
	best := 0
	for i, v := range logits {
		if v > logits[best] {
			best = i
		}
	}
	fmt.Printf("mlp: LOGITS shape %v, class %d (logit %.4f)\n", shape, best, logits[best])
	return nil
}
