/* The C side of the Go binding: trampolines from the library's callbacks into Go
 * (trampolines.c). Go code cannot take the address of a C function that calls back into
 * Go, nor turn a cgo.Handle into a void * without tripping vet, so these helpers do both. */
#ifndef GOINFER_BRIDGE_H
#define GOINFER_BRIDGE_H

#include <stdint.h>
#include <stdlib.h>
#include "infer.h"

/* infer_server_enqueue with the response trampoline; `handle` is a cgo.Handle of a
 * responseSink, deleted by Go at the FINAL response. */
infer_status goinfer_enqueue(infer_server *s, infer_request *r, uintptr_t handle,
                             uint64_t *request_id);

/* infer_server_options_set_log_callback with the log trampoline; `handle` is a cgo.Handle
 * of a Go func(LogLevel, string) that the Server deletes after infer_server_free. */
infer_status goinfer_set_log_callback(infer_server_options *o, uint32_t min_level,
                                      uintptr_t handle);

/* infer_server_set_iteration_stats_callback with the statistics trampoline; `handle` is a
 * cgo.Handle of a Go func(string), or 0 to clear the callback. The Server deletes a
 * handle once the library has stopped calling it. */
infer_status goinfer_set_iteration_stats_callback(infer_server *s, const char *model,
                                                  uintptr_t handle);

/* infer_request_add_input_borrowed for device memory (INFER_MEMORY_GPU): `data` is a
 * device address as an integer (never Go memory), and `release_handle` a cgo.Handle of
 * a Go func() that the release trampoline runs and deletes, or 0 for no release
 * callback. When the call fails the library never calls the trampoline. */
infer_status goinfer_add_input_device(infer_request *r, const char *name, infer_datatype dt,
                                      const int64_t *shape, uintptr_t ndim, uintptr_t data,
                                      uintptr_t byte_size, int64_t device_id,
                                      uintptr_t release_handle);

#endif
