package infer

/*
#include <stdlib.h>
#include "bridge.h"
*/
import "C"

import (
	"runtime/cgo"
	"sync"
	"time"
	"unsafe"
)

// GPUMode says whether the server uses a GPU.
type GPUMode uint32

// GPU modes (INFER_GPU_*).
const (
	GPUAuto     GPUMode = C.INFER_GPU_AUTO     // use one when present
	GPUOff      GPUMode = C.INFER_GPU_OFF      // never touch CUDA
	GPURequired GPUMode = C.INFER_GPU_REQUIRED // NewServer fails with Unavailable without one
)

// LogLevel is the severity of a library log message.
type LogLevel uint32

// Log levels (INFER_LOG_*); a lower value is more severe.
const (
	LogError LogLevel = C.INFER_LOG_ERROR
	LogWarn  LogLevel = C.INFER_LOG_WARN
	LogInfo  LogLevel = C.INFER_LOG_INFO
	LogDebug LogLevel = C.INFER_LOG_DEBUG
)

// ServerOptions configures NewServer. The zero value is the library's defaults: no
// repository, GPU auto, errors and warnings to stderr.
type ServerOptions struct {
	// ModelRepository is a folder of <model>/config.pbtxt (Triton's layout). Without
	// ExplicitModelControl every model in it is loaded by NewServer.
	ModelRepository string
	// ExplicitModelControl loads only StartupModels at start and then what LoadModel names.
	ExplicitModelControl bool
	// TrustedRepository lets symbolic links in the repository (or a folder given to
	// LoadModel) lead out of it; by default every path a model names stays inside.
	TrustedRepository bool
	// StartupModels are the repository models NewServer loads under explicit control.
	StartupModels []string
	// RepositoryPoll, when not zero, polls the repository this often (Server.PollRepository)
	// on a thread of the server's own; it needs a repository and no ExplicitModelControl.
	RepositoryPoll time.Duration
	// ResponseCacheBytes, when not zero, gives the server a response cache of that size
	// for the models whose config says response_cache { enable: true }.
	ResponseCacheBytes uint64
	// RateLimit turns on the rate limiter (Triton's --rate-limit=execution_count): before
	// each batch an instance takes the resources its instance_group's rate_limiter names,
	// across every model, and priority 2 gets half the turns of priority 1. Off, the
	// rate_limiter fields have no effect (as in Triton by default).
	RateLimit bool
	// RateLimitResources sizes rate limiter resources (Triton's --rate-limit-resource);
	// a resource not listed has the largest count any one loaded instance needs.
	RateLimitResources []RateLimitResource
	// ONNXRuntimeLibrary is the ONNX Runtime library file for ONNX models, searched before
	// INFER_ONNXRUNTIME_LIBRARY, libinfer's directory and the loader's paths. One ONNX
	// Runtime per process: the first server that loads an ONNX model decides.
	ONNXRuntimeLibrary string
	// ONNXRuntimeRequired makes ONNX models fail to load (Unavailable) where ONNX Runtime
	// cannot be loaded, instead of running on tract.
	ONNXRuntimeRequired bool
	// ONNXRuntimeThreads, when IntraOp or InterOp is set, is one process-wide pool shared
	// by every ONNX Runtime session that does not set its own thread counts.
	ONNXRuntimeThreads struct{ IntraOp, InterOp uint32 }
	GPU                GPUMode
	// Log, when set, receives the library's messages of LogLevel and more severe (LogWarn
	// when LogLevel is 0). It is called on library threads, concurrently, and must
	// neither block nor call Server.Close, Server.Shutdown or Server.Infer.
	Log      func(level LogLevel, message string)
	LogLevel LogLevel
}

// Server is an inference server inside this process. Its methods may be called from any
// goroutine. Close it when done: it waits for the accepted requests to finish and
// releases the library's threads and memory; there is no finalizer.
type Server struct {
	mu  sync.RWMutex
	ptr *C.infer_server
	log cgo.Handle // 0 without a Log function; deleted after the server is freed

	// The iteration statistics functions set per model; a replaced one is deleted when
	// the library has let go of it, the others after the server is freed.
	statsMu sync.Mutex
	stats   map[string]cgo.Handle
}

// NewServer checks that the loaded library implements a compatible C API, then creates
// a server (nil options = defaults). With a repository and no explicit model control,
// every model in it is loaded and the first failure fails the call.
func NewServer(opts *ServerOptions) (*Server, error) {
	libMajor, libMinor := APIVersion()
	if err := checkAPIVersion(libMajor, libMinor, APIVersionMajor, APIVersionMinor); err != nil {
		return nil, err
	}
	if opts == nil {
		opts = &ServerOptions{}
	}
	var copts *C.infer_server_options
	if err := call(func() C.infer_status { return C.infer_server_options_new(&copts) }); err != nil {
		return nil, err
	}
	s := &Server{}
	err := s.apply(copts, opts)
	var p *C.infer_server
	if err == nil {
		err = call(func() C.infer_status { return C.infer_server_new(copts, &p) })
	}
	// The server keeps its own copy of the options. The log handle goes only after both
	// are gone: the library may log until then.
	C.infer_server_options_free(copts)
	if err != nil {
		s.dropLog()
		return nil, err
	}
	s.ptr = p
	return s, nil
}

// RateLimitResource gives a rate limiter resource Count units on GPU Device, or, with
// Device -1, for the global resource of that name and every device without its own size
// (CPU instances count as device -1).
type RateLimitResource struct {
	Name   string
	Count  uint32
	Device int32
}

// apply copies opts into the C options.
func (s *Server) apply(copts *C.infer_server_options, opts *ServerOptions) error {
	if opts.ModelRepository != "" {
		path, err := cString("model repository", opts.ModelRepository)
		if err != nil {
			return err
		}
		err = call(func() C.infer_status { return C.infer_server_options_set_model_repository(copts, path) })
		freeCString(path)
		if err != nil {
			return err
		}
	}
	if opts.ExplicitModelControl {
		if err := call(func() C.infer_status {
			return C.infer_server_options_set_model_control_explicit(copts, true)
		}); err != nil {
			return err
		}
	}
	if opts.RepositoryPoll > 0 {
		ms := uint64((opts.RepositoryPoll + time.Millisecond - 1) / time.Millisecond)
		if err := call(func() C.infer_status {
			return C.infer_server_options_set_repository_poll_ms(copts, C.uint64_t(ms))
		}); err != nil {
			return err
		}
	}
	if opts.RateLimit {
		if err := call(func() C.infer_status {
			return C.infer_server_options_set_rate_limit(copts, C.INFER_RATE_LIMIT_EXECUTION_COUNT)
		}); err != nil {
			return err
		}
	}
	for _, r := range opts.RateLimitResources {
		name, err := cString("rate limiter resource", r.Name)
		if err != nil {
			return err
		}
		err = call(func() C.infer_status {
			return C.infer_server_options_add_rate_limit_resource(copts, name, C.uint32_t(r.Count), C.int32_t(r.Device))
		})
		freeCString(name)
		if err != nil {
			return err
		}
	}
	if opts.ResponseCacheBytes > 0 {
		if err := call(func() C.infer_status {
			return C.infer_server_options_set_response_cache_bytes(copts, C.uint64_t(opts.ResponseCacheBytes))
		}); err != nil {
			return err
		}
	}
	if opts.TrustedRepository {
		if err := call(func() C.infer_status {
			return C.infer_server_options_set_trusted_repository(copts, true)
		}); err != nil {
			return err
		}
	}
	if opts.ONNXRuntimeLibrary != "" {
		path, err := cString("ONNX Runtime library", opts.ONNXRuntimeLibrary)
		if err != nil {
			return err
		}
		err = call(func() C.infer_status { return C.infer_server_options_set_onnxruntime_library(copts, path) })
		freeCString(path)
		if err != nil {
			return err
		}
	}
	if opts.ONNXRuntimeRequired {
		if err := call(func() C.infer_status {
			return C.infer_server_options_set_onnxruntime_required(copts, true)
		}); err != nil {
			return err
		}
	}
	if t := opts.ONNXRuntimeThreads; t.IntraOp != 0 || t.InterOp != 0 {
		if err := call(func() C.infer_status {
			return C.infer_server_options_set_onnxruntime_threads(copts, C.uint32_t(t.IntraOp), C.uint32_t(t.InterOp))
		}); err != nil {
			return err
		}
	}
	for _, name := range opts.StartupModels {
		cname, err := cString("model name", name)
		if err != nil {
			return err
		}
		err = call(func() C.infer_status { return C.infer_server_options_add_startup_model(copts, cname) })
		freeCString(cname)
		if err != nil {
			return err
		}
	}
	if err := call(func() C.infer_status { return C.infer_server_options_set_gpu(copts, C.uint32_t(opts.GPU)) }); err != nil {
		return err
	}
	if opts.Log != nil {
		level := opts.LogLevel
		if level == 0 {
			level = LogWarn
		}
		s.log = cgo.NewHandle(opts.Log)
		if err := call(func() C.infer_status {
			return C.goinfer_set_log_callback(copts, C.uint32_t(level), C.uintptr_t(s.log))
		}); err != nil {
			return err
		}
	}
	return nil
}

func (s *Server) dropLog() {
	if s.log != 0 {
		s.log.Delete()
		s.log = 0
	}
}

// use runs f with the live C server, or fails with Unavailable once the server is
// closed. Close waits for running calls to return before it frees the server.
func (s *Server) use(f func(p *C.infer_server) error) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.ptr == nil {
		return errServerClosed
	}
	return f(s.ptr)
}

// Close shuts the server down, letting queued and running requests finish (up to 30
// s, then they end CANCELLED), and releases it; call Shutdown first for another drain
// time. Calling it again, or on nil, does nothing.
func (s *Server) Close() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	p := s.ptr
	s.ptr = nil
	s.mu.Unlock()
	if p == nil {
		return nil
	}
	C.infer_server_free(p)
	s.dropLog()
	s.statsMu.Lock()
	for model, h := range s.stats {
		h.Delete()
		delete(s.stats, model)
	}
	s.statsMu.Unlock()
	return nil
}

// Shutdown stops accepting requests (they fail with Unavailable), lets queued and
// running ones finish, and after timeout cancels what is left (each ends CANCELLED). It
// returns when every library worker has stopped. Idempotent; Close is still needed.
func (s *Server) Shutdown(timeout time.Duration) error {
	ms := uint64(timeout / time.Millisecond)
	return s.use(func(p *C.infer_server) error {
		return call(func() C.infer_status { return C.infer_server_shutdown(p, C.uint64_t(ms)) })
	})
}

// LoadModel loads a model, or replaces it if the name is loaded (new requests go to the
// new model, in-flight ones finish on the old). config is config.pbtxt text or the same
// schema as JSON; "" reads <modelDir>/config.pbtxt. modelDir "" means
// <repository>/<name> (or no folder, for built-in backends).
func (s *Server) LoadModel(name, config, modelDir string) error {
	cname, err := cString("model name", name)
	if err != nil {
		return err
	}
	defer freeCString(cname)
	cconfig, err := cStringOrNil("model config", config)
	if err != nil {
		return err
	}
	defer freeCString(cconfig)
	cdir, err := cStringOrNil("model folder", modelDir)
	if err != nil {
		return err
	}
	defer freeCString(cdir)
	return s.use(func(p *C.infer_server) error {
		return call(func() C.infer_status { return C.infer_server_load_model(p, cname, cconfig, cdir) })
	})
}

// LoadModelFiles loads (or replaces) a model from files in memory, as Triton's load with
// "file:" parameters: files maps each file's path in the model folder ("1/model.onnx")
// to its contents. They are copied to a private folder that goes with the model. config
// is required.
func (s *Server) LoadModelFiles(name, config string, files map[string][]byte) error {
	cname, err := cString("model name", name)
	if err != nil {
		return err
	}
	defer freeCString(cname)
	cconfig, err := cString("model config", config)
	if err != nil {
		return err
	}
	defer freeCString(cconfig)
	n := len(files)
	// The arrays the library reads live in C memory (cgo forbids Go pointers to Go
	// pointers); the contents are copied there too.
	slots := n
	if slots == 0 {
		slots = 1
	}
	words := C.size_t(slots) * C.size_t(unsafe.Sizeof(uintptr(0)))
	pathsC, contentsC, sizesC := C.malloc(words), C.malloc(words), C.malloc(words)
	paths := (*[1 << 28]*C.char)(pathsC)[:n:n]
	contents := (*[1 << 28]*C.uint8_t)(contentsC)[:n:n]
	sizes := (*[1 << 28]C.size_t)(sizesC)[:n:n]
	filled := 0
	defer func() {
		for i := 0; i < filled; i++ {
			freeCString(paths[i])
			C.free(unsafe.Pointer(contents[i]))
		}
		C.free(pathsC)
		C.free(contentsC)
		C.free(sizesC)
	}()
	for path, data := range files {
		cpath, err := cString("file path", path)
		if err != nil {
			return err
		}
		paths[filled] = cpath
		contents[filled] = (*C.uint8_t)(C.CBytes(data))
		sizes[filled] = C.size_t(len(data))
		filled++
	}
	return s.use(func(p *C.infer_server) error {
		return call(func() C.infer_status {
			return C.infer_server_load_model_files(p, cname, cconfig, (**C.char)(pathsC),
				(**C.uint8_t)(contentsC), (*C.size_t)(sizesC), C.size_t(n))
		})
	})
}

// PollRepository brings the loaded models in line with the repository: new folders
// load, changed ones reload, removed ones unload (no request fails). Every change is
// tried; the first failure is returned. Unavailable under ExplicitModelControl.
func (s *Server) PollRepository() error {
	return s.use(func(p *C.infer_server) error {
		return call(func() C.infer_status { return C.infer_server_poll_repository(p) })
	})
}

// RepositoryIndexJSON returns Triton's repository index: a JSON array of {"name",
// "version", "state", "reason"}, every model and version with its state (READY, LOADING,
// UNLOADING, UNAVAILABLE) and the reason of its last failure.
func (s *Server) RepositoryIndexJSON(readyOnly bool) (string, error) {
	var out string
	err := s.use(func(p *C.infer_server) error {
		var err error
		out, err = ownedString(func(o **C.char) C.infer_status {
			return C.infer_server_repository_index_json(p, C.bool(readyOnly), o)
		})
		return err
	})
	return out, err
}

// modelCall runs a call that takes the server and a model name.
func (s *Server) modelCall(name string, f func(p *C.infer_server, cname *C.char) C.infer_status) error {
	cname, err := cString("model name", name)
	if err != nil {
		return err
	}
	defer freeCString(cname)
	return s.use(func(p *C.infer_server) error {
		return call(func() C.infer_status { return f(p, cname) })
	})
}

// UnloadModel unloads a model after its queued and running requests finish.
func (s *Server) UnloadModel(name string) error {
	return s.modelCall(name, func(p *C.infer_server, cname *C.char) C.infer_status {
		return C.infer_server_unload_model(p, cname)
	})
}

// PauseModel holds batch formation for a model: requests are still accepted (queue
// limits and timeouts apply) but nothing starts until ResumeModel.
func (s *Server) PauseModel(name string) error {
	return s.modelCall(name, func(p *C.infer_server, cname *C.char) C.infer_status {
		return C.infer_server_pause_model(p, cname)
	})
}

// ResumeModel resumes a paused model.
func (s *Server) ResumeModel(name string) error {
	return s.modelCall(name, func(p *C.infer_server, cname *C.char) C.infer_status {
		return C.infer_server_resume_model(p, cname)
	})
}

// ModelReady reports whether a version of the model (LatestVersion for the latest) is
// loaded and serving.
func (s *Server) ModelReady(name string, version int64) (bool, error) {
	var ready C.bool
	err := s.modelCall(name, func(p *C.infer_server, cname *C.char) C.infer_status {
		return C.infer_server_model_ready(p, cname, C.int64_t(version), &ready)
	})
	return bool(ready), err
}

// ModelConfigJSON returns a model's configuration as JSON (Triton's field names), as
// completed by the library.
func (s *Server) ModelConfigJSON(name string, version int64) (string, error) {
	cname, err := cString("model name", name)
	if err != nil {
		return "", err
	}
	defer freeCString(cname)
	var out string
	err = s.use(func(p *C.infer_server) error {
		var err error
		out, err = ownedString(func(o **C.char) C.infer_status {
			return C.infer_server_model_config_json(p, cname, C.int64_t(version), o)
		})
		return err
	})
	return out, err
}

// StatisticsJSON returns the statistics of one model, or of all with model "".
func (s *Server) StatisticsJSON(model string) (string, error) {
	cname, err := cStringOrNil("model name", model)
	if err != nil {
		return "", err
	}
	defer freeCString(cname)
	var out string
	err = s.use(func(p *C.infer_server) error {
		var err error
		out, err = ownedString(func(o **C.char) C.infer_status { return C.infer_server_statistics_json(p, cname, o) })
		return err
	})
	return out, err
}

// MetricsPrometheus returns the statistics in Prometheus text format.
func (s *Server) MetricsPrometheus() (string, error) {
	var out string
	err := s.use(func(p *C.infer_server) error {
		var err error
		out, err = ownedString(func(o **C.char) C.infer_status { return C.infer_server_metrics_prometheus(p, o) })
		return err
	})
	return out, err
}

// SetIterationStatsCallback sets the function that receives, after each scheduler
// iteration of the generative model, one JSON object with at least timestamp_us,
// iteration, active_requests, max_requests, context_requests, generation_requests,
// context_tokens, kv_blocks_max, kv_blocks_used, kv_blocks_free, tokens_per_block and
// paused_requests. A nil fn clears it; a new one replaces the last, which is not running
// and never called again once this returns. fn runs on the model's generation thread:
// it delays the next iteration, so it must be quick and must not block, nor call
// SetIterationStatsCallback, Close or Shutdown. NotFound when the model is not loaded,
// InvalidArgument when it is not generative. It stays set across reloads of the model.
func (s *Server) SetIterationStatsCallback(model string, fn func(json string)) error {
	cmodel, err := cString("model name", model)
	if err != nil {
		return err
	}
	defer freeCString(cmodel)
	return s.use(func(p *C.infer_server) error {
		// Held across the call, so the handle the library holds is the one in the map.
		s.statsMu.Lock()
		defer s.statsMu.Unlock()
		var h cgo.Handle
		if fn != nil {
			h = cgo.NewHandle(fn)
		}
		err := call(func() C.infer_status {
			return C.goinfer_set_iteration_stats_callback(p, cmodel, C.uintptr_t(h))
		})
		if err != nil {
			if h != 0 {
				h.Delete()
			}
			return err
		}
		if old, ok := s.stats[model]; ok {
			old.Delete()
			delete(s.stats, model)
		}
		if h != 0 {
			if s.stats == nil {
				s.stats = make(map[string]cgo.Handle)
			}
			s.stats[model] = h
		}
		return nil
	})
}

// Cancel cancels a request by its id (from Enqueue, or Response.RequestID of any of its
// responses): a queued request ends at once with a FINAL Cancelled response; one already
// executing finishes normally, except on a generative model, where it stops after the
// current iteration and its FINAL is Cancelled with finish_reason "cancelled". Unknown
// or finished ids are NotFound.
func (s *Server) Cancel(requestID uint64) error {
	return s.use(func(p *C.infer_server) error {
		return call(func() C.infer_status { return C.infer_server_cancel(p, C.uint64_t(requestID)) })
	})
}
