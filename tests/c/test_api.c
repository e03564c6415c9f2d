/*
 * C API tests: strings and versions, NULL arguments, configs, infer, threads with
 * dynamic batching, callbacks that enqueue, metrics. The scheduling and backend tests
 * are in test_scheduling.c; main() runs both.
 */
#include "harness.h"

#include <pthread.h>
#include <stdarg.h>
#include <time.h>

atomic_int harness_passed;
atomic_int harness_failed;

void harness_note(const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    const char *p = buf;
    while (*p == ' ') p++;
    if (*p) fprintf(stderr, " -- %s", p);
    fputc('\n', stderr);
}

double harness_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void harness_sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int harness_wait_at_least(atomic_int *counter, int want, double timeout_s) {
    double end = harness_now() + timeout_s;
    while (atomic_load(counter) < want) {
        if (harness_now() > end) return 0;
        harness_sleep_ms(1);
    }
    return 1;
}

const char *ADD_SUB_PBTXT =
    "name: \"add_sub\"\n"
    "backend: \"add_sub\"\n"
    "max_batch_size: 16\n"
    "input [\n"
    "  { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },\n"
    "  { name: \"INPUT1\" data_type: TYPE_FP32 dims: [ 4 ] }\n"
    "]\n"
    "output [\n"
    "  { name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },\n"
    "  { name: \"OUTPUT1\" data_type: TYPE_FP32 dims: [ 4 ] }\n"
    "]\n"
    "dynamic_batching { max_queue_delay_microseconds: 500 }\n"
    "parameters { key: \"execute_delay_us\" value { string_value: \"1000\" } }\n";

static const char *ADD_SUB_JSON =
    "{\n"
    "  \"name\": \"add_sub_json\",\n"
    "  \"backend\": \"add_sub\",\n"
    "  \"max_batch_size\": 8,\n"
    "  \"input\": [\n"
    "    {\"name\": \"INPUT0\", \"data_type\": \"TYPE_FP32\", \"dims\": [4]},\n"
    "    {\"name\": \"INPUT1\", \"data_type\": \"TYPE_FP32\", \"dims\": [4]}\n"
    "  ],\n"
    "  \"output\": [\n"
    "    {\"name\": \"OUTPUT0\", \"data_type\": \"TYPE_FP32\", \"dims\": [4]},\n"
    "    {\"name\": \"OUTPUT1\", \"data_type\": \"TYPE_FP32\", \"dims\": [4]}\n"
    "  ]\n"
    "}\n";

infer_server *new_server(void) {
    infer_server_options *o = NULL;
    infer_server *s = NULL;
    CHECK_OK(infer_server_options_new(&o));
    CHECK_OK(infer_server_options_set_gpu(o, INFER_GPU_OFF));
    CHECK_OK(infer_server_new(o, &s));
    infer_server_options_free(o);
    return s;
}

infer_request *add_sub_request(infer_server *s, const char *model, const float a[4],
                               const float b[4]) {
    static const int64_t shape[2] = {1, 4};
    infer_request *r = NULL;
    infer_status st = infer_request_new(s, model, -1, &r);
    if (st == INFER_STATUS_OK)
        st = infer_request_add_input(r, "INPUT0", INFER_DATATYPE_FP32, shape, 2, a, 16);
    if (st == INFER_STATUS_OK)
        st = infer_request_add_input(r, "INPUT1", INFER_DATATYPE_FP32, shape, 2, b, 16);
    /* Counted only when it fails, so the totals do not grow with request counts. */
    if (st != INFER_STATUS_OK)
        CHECK(st == INFER_STATUS_OK, "add_sub request for '%s': %s: %s", model,
              infer_status_string(st), infer_last_error_message());
    return r;
}

/* 1 when the response is OK with OUTPUT0 = a+b and OUTPUT1 = a-b, shape [1,4]. */
int expect_add_sub(const infer_response *r, const float a[4], const float b[4]) {
    if (infer_response_status(r) != INFER_STATUS_OK) return 0;
    for (int k = 0; k < 2; k++) {
        infer_datatype dt = 0;
        const int64_t *shape = NULL;
        size_t ndim = 0, bytes = 0;
        const void *data = NULL;
        if (infer_response_output_by_name(r, k ? "OUTPUT1" : "OUTPUT0", &dt, &shape, &ndim,
                                          &data, &bytes) != INFER_STATUS_OK)
            return 0;
        if (dt != INFER_DATATYPE_FP32 || ndim != 2 || shape[0] != 1 || shape[1] != 4 ||
            bytes != 16)
            return 0;
        const float *v = data;
        for (int i = 0; i < 4; i++)
            if (v[i] != (k ? a[i] - b[i] : a[i] + b[i])) return 0;
    }
    return 1;
}

static void test_versions_and_strings(void) {
    uint32_t major = 99, minor = 99;
    CHECK_OK(infer_api_version(&major, &minor));
    CHECK(major == INFER_API_VERSION_MAJOR && minor >= INFER_API_VERSION_MINOR,
          "library API %u.%u, header %d.%d", major, minor, INFER_API_VERSION_MAJOR,
          INFER_API_VERSION_MINOR);
    CHECK(infer_version() != NULL && strlen(infer_version()) > 0);
    CHECK(strcmp(infer_status_string(INFER_STATUS_OK), "OK") == 0);
    CHECK(strcmp(infer_status_string(INFER_STATUS_INVALID_ARGUMENT), "INVALID_ARGUMENT") == 0);
    CHECK(strcmp(infer_status_string(INFER_STATUS_RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED") == 0);
    CHECK(strcmp(infer_status_string(INFER_STATUS_CANCELLED), "CANCELLED") == 0);
    CHECK(strcmp(infer_status_string(12345), "UNKNOWN") == 0);
    CHECK(strcmp(infer_datatype_string(INFER_DATATYPE_FP32), "FP32") == 0);
    CHECK(strcmp(infer_datatype_string(INFER_DATATYPE_BYTES), "BYTES") == 0);
    CHECK(strcmp(infer_datatype_string(999), "INVALID") == 0);
    CHECK(infer_datatype_from_string("FP32") == INFER_DATATYPE_FP32);
    CHECK(infer_datatype_from_string("TYPE_INT64") == INFER_DATATYPE_INT64);
    CHECK(infer_datatype_from_string("TYPE_STRING") == INFER_DATATYPE_BYTES);
    CHECK(infer_datatype_from_string("NOPE") == INFER_DATATYPE_INVALID);
    CHECK(infer_datatype_from_string(NULL) == INFER_DATATYPE_INVALID);
    CHECK(infer_datatype_byte_size(INFER_DATATYPE_FP64) == 8);
    CHECK(infer_datatype_byte_size(INFER_DATATYPE_FP16) == 2);
    CHECK(infer_datatype_byte_size(INFER_DATATYPE_BYTES) == 0);
    CHECK(infer_last_error_message() != NULL);
}

static void noop_response(void *ud, infer_response *r, uint32_t flags) {
    (void)ud;
    (void)flags;
    infer_response_free(r);
}

static void test_null_arguments(void) {
    const int64_t shape[2] = {1, 4};
    const float v[4] = {0};
    uint32_t u = 0;
    bool ready = false;
    char *str = NULL;
    infer_server_options *o = NULL;
    infer_server *s = NULL;
    infer_request *r = NULL;
    infer_response *resp = NULL;
    infer_backend be = {0};
    be.struct_size = sizeof be;

    CHECK_STATUS(infer_api_version(NULL, &u), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_api_version(&u, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_new(NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_set_model_repository(NULL, "/tmp"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_set_model_control_explicit(NULL, true), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_set_gpu(NULL, INFER_GPU_OFF), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_set_log_callback(NULL, INFER_LOG_ERROR, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_register_backend(NULL, "b", &be, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_new(NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);

    CHECK_OK(infer_server_options_new(&o));
    CHECK_STATUS(infer_server_options_set_model_repository(o, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_register_backend(o, NULL, &be, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_register_backend(o, "b", NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_register_backend(o, "b", &be, NULL), INFER_STATUS_INVALID_ARGUMENT); /* execute NULL */
    CHECK_STATUS(infer_server_options_set_gpu(o, 7), INFER_STATUS_INVALID_ARGUMENT);
    /* ONNX Runtime: a path (NULL or "" clears it), required, global thread pools (at most 4096). */
    CHECK_OK(infer_server_options_set_onnxruntime_library(o, "/opt/ort/libonnxruntime.so.1.32.0"));
    CHECK_OK(infer_server_options_set_onnxruntime_library(o, NULL));
    CHECK_OK(infer_server_options_set_onnxruntime_required(o, false));
    CHECK_OK(infer_server_options_set_onnxruntime_threads(o, 2, 1));
    CHECK_STATUS(infer_server_options_set_onnxruntime_threads(o, 5000, 1), INFER_STATUS_INVALID_ARGUMENT);
    infer_server_options_free(o);
    CHECK_STATUS(infer_server_options_set_onnxruntime_library(NULL, "x"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_set_onnxruntime_required(NULL, true), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_options_set_onnxruntime_threads(NULL, 1, 1), INFER_STATUS_INVALID_ARGUMENT);

    CHECK_STATUS(infer_server_register_backend(NULL, "b", &be, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_shutdown(NULL, 0), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_load_model(NULL, "m", ADD_SUB_PBTXT, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_unload_model(NULL, "m"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_model_ready(NULL, "m", -1, &ready), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_model_config_json(NULL, "m", -1, &str), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_statistics_json(NULL, NULL, &str), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_metrics_prometheus(NULL, &str), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_pause_model(NULL, "m"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_resume_model(NULL, "m"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_cancel(NULL, 1), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_set_iteration_stats_callback(NULL, "m", NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_enqueue(NULL, NULL, noop_response, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_infer(NULL, NULL, &resp), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_new(NULL, "m", -1, &r), INFER_STATUS_INVALID_ARGUMENT);

    s = new_server();
    CHECK_OK(infer_server_load_model(s, "add_sub", ADD_SUB_PBTXT, NULL));
    CHECK_STATUS(infer_server_load_model(s, NULL, ADD_SUB_PBTXT, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_unload_model(s, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_model_ready(s, "add_sub", -1, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_model_ready(s, NULL, -1, &ready), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_model_config_json(s, "add_sub", -1, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_model_config_json(s, NULL, -1, &str), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_statistics_json(s, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_metrics_prometheus(s, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_pause_model(s, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_resume_model(s, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_set_iteration_stats_callback(s, NULL, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_set_iteration_stats_callback(s, "nope", NULL, NULL), INFER_STATUS_NOT_FOUND);
    CHECK_STATUS(infer_server_set_iteration_stats_callback(s, "add_sub", NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_register_backend(s, NULL, &be, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_register_backend(s, "b", NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_new(s, NULL, -1, &r), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_new(s, "add_sub", -1, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_enqueue(s, NULL, noop_response, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_server_infer(s, NULL, &resp), INFER_STATUS_INVALID_ARGUMENT);

    /* Request setters with a NULL request. */
    CHECK_STATUS(infer_request_set_correlation_id(NULL, 1), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_correlation_id_str(NULL, "x"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_flags(NULL, 0), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_priority(NULL, 1), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_timeout_us(NULL, 1), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_input(NULL, "INPUT0", INFER_DATATYPE_FP32, shape, 2, v, 16), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_input_borrowed(NULL, "INPUT0", INFER_DATATYPE_FP32, shape, 2, v, 16, INFER_MEMORY_CPU, 0, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_requested_output(NULL, "OUTPUT0"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_parameter_int(NULL, "k", 1), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_parameter_double(NULL, "k", 1.0), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_parameter_bool(NULL, "k", true), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_parameter_string(NULL, "k", "v"), INFER_STATUS_INVALID_ARGUMENT);

    /* NULL strings, shapes and data on a real request. */
    CHECK_OK(infer_request_new(s, "add_sub", -1, &r));
    CHECK_STATUS(infer_request_set_correlation_id_str(r, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_input(r, NULL, INFER_DATATYPE_FP32, shape, 2, v, 16), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_input(r, "INPUT0", INFER_DATATYPE_FP32, NULL, 2, v, 16), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_input(r, "INPUT0", INFER_DATATYPE_FP32, shape, 2, NULL, 16), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_requested_output(r, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_parameter_int(r, NULL, 1), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_set_parameter_string(r, "k", NULL), INFER_STATUS_INVALID_ARGUMENT);
    /* A wrong byte size names the tensor. */
    CHECK_STATUS(infer_request_add_input(r, "INPUT0", INFER_DATATYPE_FP32, shape, 2, v, 12), INFER_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(infer_last_error_message(), "INPUT0") != NULL, "%s", infer_last_error_message());
    /* NULL callback: enqueue takes the request and fails. */
    CHECK_STATUS(infer_server_enqueue(s, r, NULL, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_OK(infer_request_new(s, "add_sub", -1, &r));
    CHECK_STATUS(infer_server_infer(s, r, NULL), INFER_STATUS_INVALID_ARGUMENT);

    /* Responses and batches: NULL reads as empty, never a crash. */
    CHECK(infer_response_request_id(NULL) == 0);
    CHECK(infer_response_status(NULL) == INFER_STATUS_INVALID_ARGUMENT);
    CHECK(infer_response_error_message(NULL) == NULL);
    CHECK(infer_response_model_name(NULL) != NULL && infer_response_model_name(NULL)[0] == '\0');
    CHECK(infer_response_model_version(NULL) == 0);
    CHECK(infer_response_correlation_id(NULL) == 0);
    CHECK(infer_response_output_count(NULL) == 0);
    CHECK_STATUS(infer_response_output(NULL, 0, NULL, NULL, NULL, NULL, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_response_output_by_name(NULL, "OUTPUT0", NULL, NULL, NULL, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_response_parameter_int(NULL, "k", NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_response_parameter_string(NULL, "k", NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK(infer_batch_size(NULL) == 0);
    CHECK(infer_batch_request_count(NULL) == 0);
    CHECK(infer_batch_input_count(NULL) == 0);
    CHECK_STATUS(infer_batch_input(NULL, "x", NULL, NULL, NULL, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_batch_input_by_index(NULL, 0, NULL, NULL, NULL, NULL, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_batch_output(NULL, "x", shape, 2, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_batch_output_bytes(NULL, "x", shape, 2, 0, NULL), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_batch_set_request_error(NULL, 0, INFER_STATUS_INTERNAL, "x"), INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_batch_set_error_message(NULL, "x"), INFER_STATUS_INVALID_ARGUMENT);

    /* Frees accept NULL. */
    infer_string_free(NULL);
    infer_request_free(NULL);
    infer_response_free(NULL);
    infer_server_options_free(NULL);
    infer_server_free(NULL);
    CHECK(1, "NULL frees returned");
    infer_server_free(s);
}

static int has_line_column(const char *msg) {
    const char *p = strstr(msg, "line ");
    unsigned line = 0, col = 0;
    return p && sscanf(p, "line %u:%u", &line, &col) == 2 && line > 0 && col > 0;
}

static void test_configs_and_infer(void) {
    infer_server *s = new_server();
    bool ready = false;
    char *json = NULL;
    const float a[4] = {1, 2, 3, 4}, b[4] = {10, 20, 30, 40};

    CHECK_OK(infer_server_load_model(s, "add_sub", ADD_SUB_PBTXT, NULL));
    CHECK_OK(infer_server_load_model(s, "add_sub_json", ADD_SUB_JSON, NULL));
    CHECK_OK(infer_server_model_ready(s, "add_sub", -1, &ready));
    CHECK(ready);
    CHECK_OK(infer_server_model_ready(s, "add_sub_json", 1, &ready));
    CHECK(ready);
    CHECK_OK(infer_server_model_ready(s, "nope", -1, &ready));
    CHECK(!ready);
    CHECK_OK(infer_server_model_config_json(s, "add_sub", -1, &json));
    CHECK(json && strstr(json, "\"max_batch_size\":16") != NULL, "%s", json ? json : "(null)");
    infer_string_free(json);

    /* Bad configs: INVALID_ARGUMENT with line:column. */
    CHECK_STATUS(infer_server_load_model(s, "bad", "name: \"bad\"\nbackend: \"add_sub\"\nmax_batch_size: oops\n", NULL),
                 INFER_STATUS_INVALID_ARGUMENT);
    CHECK(has_line_column(infer_last_error_message()) && strstr(infer_last_error_message(), "line 3:"),
          "%s", infer_last_error_message());
    CHECK_STATUS(infer_server_load_model(s, "bad", "{\n  \"name\": \"bad\",\n  \"max_batch_size\": ,\n}\n", NULL),
                 INFER_STATUS_INVALID_ARGUMENT);
    CHECK(has_line_column(infer_last_error_message()) && strstr(infer_last_error_message(), "line 3:"),
          "%s", infer_last_error_message());
    CHECK_STATUS(infer_server_load_model(s, "bad", "name: \"bad\"\nbackend: \"add_sub\"\n  no_such_field: 1\n", NULL),
                 INFER_STATUS_INVALID_ARGUMENT);
    CHECK(has_line_column(infer_last_error_message()), "%s", infer_last_error_message());
    CHECK_OK(infer_server_model_ready(s, "bad", -1, &ready));
    CHECK(!ready, "a model whose config failed is not ready");
    CHECK_STATUS(infer_request_new(s, "bad", -1, &(infer_request *){NULL}), INFER_STATUS_NOT_FOUND);

    /* infer on both models. */
    const char *models[2] = {"add_sub", "add_sub_json"};
    for (int m = 0; m < 2; m++) {
        infer_response *resp = NULL;
        CHECK_OK(infer_server_infer(s, add_sub_request(s, models[m], a, b), &resp));
        CHECK(resp != NULL && expect_add_sub(resp, a, b), "%s: %s", models[m],
              resp ? (infer_response_error_message(resp) ? infer_response_error_message(resp) : "wrong values") : "no response");
        CHECK(infer_response_output_count(resp) == 2);
        CHECK(strcmp(infer_response_model_name(resp), models[m]) == 0);
        CHECK(infer_response_model_version(resp) == 1);
        CHECK(infer_response_error_message(resp) == NULL);
        CHECK(infer_response_request_id(resp) != 0);
        CHECK_STATUS(infer_response_output_by_name(resp, "NOPE", NULL, NULL, NULL, NULL, NULL), INFER_STATUS_NOT_FOUND);
        CHECK_STATUS(infer_response_output(resp, 2, NULL, NULL, NULL, NULL, NULL, NULL), INFER_STATUS_INVALID_ARGUMENT);
        infer_response_free(resp);
    }

    /* One requested output. */
    infer_request *r = add_sub_request(s, "add_sub", a, b);
    infer_response *resp = NULL;
    CHECK_OK(infer_request_add_requested_output(r, "OUTPUT1"));
    CHECK_OK(infer_server_infer(s, r, &resp));
    CHECK(infer_response_output_count(resp) == 1);
    const char *name = NULL;
    const void *data = NULL;
    CHECK_OK(infer_response_output(resp, 0, &name, NULL, NULL, NULL, &data, NULL));
    CHECK(name && strcmp(name, "OUTPUT1") == 0 && ((const float *)data)[3] == -36.0f);
    infer_response_free(resp);

    /* Metrics name the model. */
    char *text = NULL;
    CHECK_OK(infer_server_metrics_prometheus(s, &text));
    CHECK(text && strstr(text, "infer_request_success_total{model=\"add_sub\",version=\"1\"}") != NULL);
    infer_string_free(text);
    CHECK_OK(infer_server_unload_model(s, "add_sub_json"));
    CHECK_STATUS(infer_server_unload_model(s, "add_sub_json"), INFER_STATUS_NOT_FOUND);
    infer_server_free(s);
}

/* ---- several threads enqueueing, dynamic batching, exactly one FINAL each ---- */

#define THREADS 4
#define PER_THREAD 200

struct ctx {
    float a[4], b[4];
    atomic_int finals;
    atomic_int calls;
    atomic_int ok;
};

static atomic_int total_finals;

static void count_response(void *ud, infer_response *resp, uint32_t flags) {
    struct ctx *c = ud;
    atomic_fetch_add(&c->calls, 1);
    if (expect_add_sub(resp, c->a, c->b)) atomic_fetch_add(&c->ok, 1);
    infer_response_free(resp);
    if (flags & INFER_RESPONSE_FLAG_FINAL) {
        atomic_fetch_add(&c->finals, 1);
        atomic_fetch_add(&total_finals, 1);
    }
}

struct worker {
    infer_server *s;
    struct ctx *ctx;
    atomic_int *enqueue_errors;
};

static void *enqueue_thread(void *arg) {
    struct worker *w = arg;
    for (int i = 0; i < PER_THREAD; i++) {
        struct ctx *c = &w->ctx[i];
        infer_request *r = add_sub_request(w->s, "add_sub", c->a, c->b);
        uint64_t id = 0;
        if (infer_server_enqueue(w->s, r, count_response, c, &id) != INFER_STATUS_OK || id == 0)
            atomic_fetch_add(w->enqueue_errors, 1);
    }
    return NULL;
}

static void test_threads_dynamic_batching(void) {
    infer_server *s = new_server();
    CHECK_OK(infer_server_load_model(s, "add_sub", ADD_SUB_PBTXT, NULL));
    static struct ctx ctxs[THREADS * PER_THREAD];
    for (int i = 0; i < THREADS * PER_THREAD; i++) {
        for (int k = 0; k < 4; k++) {
            ctxs[i].a[k] = (float)(i * 4 + k);
            ctxs[i].b[k] = (float)(k - i);
        }
        atomic_init(&ctxs[i].finals, 0);
        atomic_init(&ctxs[i].calls, 0);
        atomic_init(&ctxs[i].ok, 0);
    }
    atomic_int errors;
    atomic_init(&errors, 0);
    atomic_store(&total_finals, 0);
    pthread_t th[THREADS];
    struct worker w[THREADS];
    for (int t = 0; t < THREADS; t++) {
        w[t] = (struct worker){s, &ctxs[t * PER_THREAD], &errors};
        CHECK(pthread_create(&th[t], NULL, enqueue_thread, &w[t]) == 0);
    }
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
    CHECK(atomic_load(&errors) == 0, "%d enqueue errors", atomic_load(&errors));
    CHECK(harness_wait_at_least(&total_finals, THREADS * PER_THREAD, 30.0), "finals: %d",
          atomic_load(&total_finals));
    harness_sleep_ms(20); /* a duplicate FINAL would arrive now */
    int once = 0, correct = 0;
    for (int i = 0; i < THREADS * PER_THREAD; i++) {
        once += atomic_load(&ctxs[i].finals) == 1 && atomic_load(&ctxs[i].calls) == 1;
        correct += atomic_load(&ctxs[i].ok) == 1;
    }
    CHECK(once == THREADS * PER_THREAD, "%d of %d requests got exactly one FINAL", once, THREADS * PER_THREAD);
    CHECK(correct == THREADS * PER_THREAD, "%d of %d correct", correct, THREADS * PER_THREAD);

    char *json = NULL;
    CHECK_OK(infer_server_statistics_json(s, "add_sub", &json));
    long inferences = -1, executions = -1;
    const char *p = json ? strstr(json, "\"inference_count\":") : NULL;
    if (p) sscanf(p, "\"inference_count\":%ld", &inferences);
    p = json ? strstr(json, "\"execution_count\":") : NULL;
    if (p) sscanf(p, "\"execution_count\":%ld", &executions);
    CHECK(inferences == THREADS * PER_THREAD, "%s", json ? json : "(null)");
    CHECK(executions > 0 && executions < inferences, "no batching: %ld executions for %ld requests",
          executions, inferences);
    printf("   %ld requests in %ld executions\n", inferences, executions);
    infer_string_free(json);
    infer_server_free(s);
}

/* ---- a callback may enqueue the next request; blocking calls are refused ---- */

struct chain {
    infer_server *s;
    atomic_int steps;
    atomic_int refused_infer;
    atomic_int done;
};

static void chain_step(void *ud, infer_response *resp, uint32_t flags) {
    struct chain *c = ud;
    int ok = infer_response_status(resp) == INFER_STATUS_OK;
    infer_response_free(resp);
    if (!(flags & INFER_RESPONSE_FLAG_FINAL)) return;
    if (!ok || atomic_fetch_add(&c->steps, 1) + 1 >= 5) {
        atomic_store(&c->done, 1);
        return;
    }
    const float a[4] = {1, 1, 1, 1};
    infer_response *out = NULL;
    infer_request *probe = add_sub_request(c->s, "add_sub", a, a);
    if (infer_server_infer(c->s, probe, &out) == INFER_STATUS_INVALID_ARGUMENT)
        atomic_fetch_add(&c->refused_infer, 1);
    if (infer_server_enqueue(c->s, add_sub_request(c->s, "add_sub", a, a), chain_step, c, NULL) !=
        INFER_STATUS_OK)
        atomic_store(&c->done, 1);
}

static void test_enqueue_from_callback(void) {
    struct chain c = {.s = new_server()};
    CHECK_OK(infer_server_load_model(c.s, "add_sub", ADD_SUB_PBTXT, NULL));
    const float a[4] = {1, 1, 1, 1};
    CHECK_OK(infer_server_enqueue(c.s, add_sub_request(c.s, "add_sub", a, a), chain_step, &c, NULL));
    CHECK(harness_wait_at_least(&c.done, 1, 20.0));
    CHECK(atomic_load(&c.steps) == 5, "steps: %d", atomic_load(&c.steps));
    CHECK(atomic_load(&c.refused_infer) == 4, "infer from a callback refused %d of 4 times",
          atomic_load(&c.refused_infer));
    infer_server_free(c.s);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    RUN(test_versions_and_strings);
    RUN(test_null_arguments);
    RUN(test_configs_and_infer);
    RUN(test_threads_dynamic_batching);
    RUN(test_enqueue_from_callback);
    RUN(test_custom_backend);
    RUN(test_custom_backend_on_options);
    RUN(test_decoupled_backend);
    RUN(test_pause_and_batch_sizes);
    RUN(test_queue_full);
    RUN(test_cancel_queued);
    RUN(test_shutdown_with_queued_requests);
    RUN(test_borrowed_inputs);
    RUN(test_sequence_single);
    RUN(test_sequence_string_ids);
    RUN(test_sequence_errors);
    RUN(test_sequence_controls);
    int passed = atomic_load(&harness_passed), failed = atomic_load(&harness_failed);
    fflush(stderr);
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
