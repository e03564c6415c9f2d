// Trampolines from the library's C callbacks into the Go functions exported in
// callbacks.go. They run on library threads; the Go side never blocks there.
#include "bridge.h"
#include "_cgo_export.h"

static void on_response(void *user_data, infer_response *response, uint32_t flags) {
    goinferOnResponse((uintptr_t)user_data, response, flags);
}

infer_status goinfer_enqueue(infer_server *s, infer_request *r, uintptr_t handle,
                             uint64_t *request_id) {
    return infer_server_enqueue(s, r, on_response, (void *)handle, request_id);
}

static void on_log(void *user_data, uint32_t level, const char *message) {
    goinferOnLog((uintptr_t)user_data, level, (char *)message);
}

infer_status goinfer_set_log_callback(infer_server_options *o, uint32_t min_level,
                                      uintptr_t handle) {
    return infer_server_options_set_log_callback(o, min_level, on_log, (void *)handle);
}

static void on_iteration_stats(void *user_data, const char *json) {
    goinferOnIterationStats((uintptr_t)user_data, (char *)json);
}

infer_status goinfer_set_iteration_stats_callback(infer_server *s, const char *model,
                                                  uintptr_t handle) {
    if (handle == 0) return infer_server_set_iteration_stats_callback(s, model, NULL, NULL);
    return infer_server_set_iteration_stats_callback(s, model, on_iteration_stats,
                                                     (void *)handle);
}

static void on_release(void *user_data) {
    goinferOnRelease((uintptr_t)user_data);
}

infer_status goinfer_add_input_device(infer_request *r, const char *name, infer_datatype dt,
                                      const int64_t *shape, uintptr_t ndim, uintptr_t data,
                                      uintptr_t byte_size, int64_t device_id,
                                      uintptr_t release_handle) {
    return infer_request_add_input_borrowed(r, name, dt, shape, ndim, (const void *)data,
                                            byte_size, INFER_MEMORY_GPU, device_id,
                                            release_handle != 0 ? on_release : NULL,
                                            (void *)release_handle);
}
