/*
 * C API tests: a custom backend written in C, pause/resume and batch sizes, queue
 * limits, cancellation, shutdown with queued requests, borrowed inputs.
 */
#include "harness.h"

/* ---- a custom backend: OUT = 2 * IN (INT32 [2]); IN[0] == -1 fails that request,
 *      IN[0] == -99 fails the whole execution ---- */

static atomic_int be_inits, be_finis, be_executions, be_bad_model_name;

struct instance {
    int index;
};

static uint32_t be_instance_init(void *ud, const char *model, const char *config_json,
                                 uint32_t index, int32_t gpu, void **state) {
    (void)ud;
    if (strcmp(model, "doubler") != 0 || strstr(config_json, "\"max_batch_size\":8") == NULL ||
        gpu != -1)
        atomic_fetch_add(&be_bad_model_name, 1);
    struct instance *in = malloc(sizeof *in);
    if (!in) return INFER_STATUS_RESOURCE_EXHAUSTED;
    in->index = (int)index;
    *state = in;
    atomic_fetch_add(&be_inits, 1);
    return INFER_STATUS_OK;
}

static uint32_t be_execute(void *state, infer_batch *b) {
    (void)state;
    atomic_fetch_add(&be_executions, 1);
    infer_datatype dt = 0;
    const int64_t *shape = NULL;
    size_t ndim = 0, bytes = 0;
    const void *data = NULL;
    uint32_t st = infer_batch_input(b, "IN", &dt, &shape, &ndim, &data, &bytes);
    if (st != INFER_STATUS_OK) return st;
    uint32_t rows = infer_batch_size(b);
    if (dt != INFER_DATATYPE_INT32 || ndim != 2 || shape[0] != rows || shape[1] != 2 ||
        bytes != rows * 2 * sizeof(int32_t)) {
        infer_batch_set_error_message(b, "unexpected input layout");
        return INFER_STATUS_INTERNAL;
    }
    if (infer_batch_input(b, "NOPE", NULL, NULL, NULL, NULL, NULL) != INFER_STATUS_NOT_FOUND) {
        infer_batch_set_error_message(b, "NOPE was found");
        return INFER_STATUS_INTERNAL;
    }
    const int32_t *in = data;
    for (uint32_t r = 0; r < rows; r++) {
        if (in[2 * r] == -99) {
            infer_batch_set_error_message(b, "doubler: the whole batch failed on purpose");
            return INFER_STATUS_UNAVAILABLE;
        }
    }
    void *out = NULL;
    int64_t oshape[2] = {rows, 2};
    st = infer_batch_output(b, "OUT", oshape, 2, &out);
    if (st != INFER_STATUS_OK) return st;
    int32_t *o = out;
    for (uint32_t i = 0; i < rows * 2; i++) o[i] = 2 * in[i];
    for (uint32_t r = 0; r < rows; r++)
        if (in[2 * r] == -1)
            infer_batch_set_request_error(b, r, INFER_STATUS_UNSUPPORTED, "doubler: row rejected");
    return INFER_STATUS_OK;
}

static void be_instance_fini(void *state) {
    free(state);
    atomic_fetch_add(&be_finis, 1);
}

/* backend_user_data is the counter of the registration being finalized. */
static void be_finalize(void *ud) {
    atomic_fetch_add((atomic_int *)ud, 1);
}

static const char *DOUBLER =
    "name: \"doubler\"\n"
    "backend: \"doubler_backend\"\n"
    "max_batch_size: 8\n"
    "input [ { name: \"IN\" data_type: TYPE_INT32 dims: [ 2 ] } ]\n"
    "output [ { name: \"OUT\" data_type: TYPE_INT32 dims: [ 2 ] } ]\n"
    "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
    "dynamic_batching { }\n";

static infer_backend doubler_backend(void) {
    infer_backend be = {0};
    be.struct_size = sizeof be;
    be.instance_init = be_instance_init;
    be.execute = be_execute;
    be.instance_fini = be_instance_fini;
    be.finalize = be_finalize;
    return be;
}

struct slot {
    atomic_int finals;
    atomic_int status;
    int32_t out[2];
    char error[256];
};

static void slot_response(void *ud, infer_response *resp, uint32_t flags) {
    struct slot *sl = ud;
    const void *data = NULL;
    size_t bytes = 0;
    atomic_store(&sl->status, (int)infer_response_status(resp));
    const char *e = infer_response_error_message(resp);
    snprintf(sl->error, sizeof sl->error, "%s", e ? e : "");
    if (infer_response_output_by_name(resp, "OUT", NULL, NULL, NULL, &data, &bytes) == INFER_STATUS_OK &&
        bytes == sizeof sl->out)
        memcpy(sl->out, data, sizeof sl->out);
    infer_response_free(resp);
    if (flags & INFER_RESPONSE_FLAG_FINAL) atomic_fetch_add(&sl->finals, 1);
}

static uint64_t enqueue_doubler(infer_server *s, int32_t x, struct slot *sl) {
    const int64_t shape[2] = {1, 2};
    const int32_t v[2] = {x, x + 1};
    infer_request *r = NULL;
    uint64_t id = 0;
    memset(sl, 0, sizeof *sl);
    atomic_store(&sl->status, -1);
    CHECK_OK(infer_request_new(s, "doubler", -1, &r));
    CHECK_OK(infer_request_add_input(r, "IN", INFER_DATATYPE_INT32, shape, 2, v, sizeof v));
    CHECK_OK(infer_server_enqueue(s, r, slot_response, sl, &id));
    return id;
}

void test_custom_backend(void) {
    atomic_int finalized, finalized_dup;
    atomic_init(&finalized, 0);
    atomic_init(&finalized_dup, 0);
    atomic_store(&be_inits, 0);
    atomic_store(&be_finis, 0);
    atomic_store(&be_bad_model_name, 0);
    infer_server *s = new_server();
    infer_backend be = doubler_backend();
    CHECK_OK(infer_server_register_backend(s, "doubler_backend", &be, &finalized));
    /* A refused registration takes nothing: its finalize must never run. */
    CHECK_STATUS(infer_server_register_backend(s, "doubler_backend", &be, &finalized_dup), INFER_STATUS_ALREADY_EXISTS);
    CHECK(atomic_load(&finalized_dup) == 0, "a refused registration was finalized");
    CHECK_OK(infer_server_load_model(s, "doubler", DOUBLER, NULL));
    CHECK(atomic_load(&be_inits) == 2, "instance_init ran %d times", atomic_load(&be_inits));
    CHECK(atomic_load(&be_bad_model_name) == 0);

    /* One batch of three: the middle request fails alone. */
    struct slot sl[4];
    CHECK_OK(infer_server_pause_model(s, "doubler"));
    enqueue_doubler(s, 3, &sl[0]);
    enqueue_doubler(s, -1, &sl[1]);
    enqueue_doubler(s, 7, &sl[2]);
    int before = atomic_load(&be_executions);
    CHECK_OK(infer_server_resume_model(s, "doubler"));
    for (int i = 0; i < 3; i++) CHECK(harness_wait_at_least(&sl[i].finals, 1, 10.0));
    CHECK(atomic_load(&be_executions) - before == 1, "%d executions for 3 paused requests",
          atomic_load(&be_executions) - before);
    CHECK(atomic_load(&sl[0].status) == INFER_STATUS_OK && sl[0].out[0] == 6 && sl[0].out[1] == 8,
          "%d %s [%d %d]", atomic_load(&sl[0].status), sl[0].error, sl[0].out[0], sl[0].out[1]);
    CHECK(atomic_load(&sl[1].status) == INFER_STATUS_UNSUPPORTED && strcmp(sl[1].error, "doubler: row rejected") == 0,
          "%d %s", atomic_load(&sl[1].status), sl[1].error);
    CHECK(atomic_load(&sl[2].status) == INFER_STATUS_OK && sl[2].out[0] == 14 && sl[2].out[1] == 16);

    /* execute returns an error: every request of the batch gets it, the model keeps serving. */
    enqueue_doubler(s, -99, &sl[3]);
    CHECK(harness_wait_at_least(&sl[3].finals, 1, 10.0));
    CHECK(atomic_load(&sl[3].status) == INFER_STATUS_UNAVAILABLE &&
              strcmp(sl[3].error, "doubler: the whole batch failed on purpose") == 0,
          "%d %s", atomic_load(&sl[3].status), sl[3].error);
    enqueue_doubler(s, 20, &sl[0]);
    CHECK(harness_wait_at_least(&sl[0].finals, 1, 10.0));
    CHECK(atomic_load(&sl[0].status) == INFER_STATUS_OK && sl[0].out[0] == 40);
    for (int i = 0; i < 4; i++) CHECK(atomic_load(&sl[i].finals) == 1);

    char *json = NULL;
    CHECK_OK(infer_server_statistics_json(s, "doubler", &json));
    CHECK(json && strstr(json, "\"failure_count\":2") && strstr(json, "\"success_count\":3"), "%s",
          json ? json : "(null)");
    infer_string_free(json);

    CHECK(atomic_load(&finalized) == 0, "finalize ran while the server is alive");
    infer_server_free(s);
    CHECK(atomic_load(&be_finis) == 2, "instance_fini ran %d times", atomic_load(&be_finis));
    CHECK(atomic_load(&finalized) == 1, "finalize ran %d times", atomic_load(&finalized));
}

void test_custom_backend_on_options(void) {
    atomic_int finalized, finalized_dup;
    atomic_init(&finalized, 0);
    atomic_init(&finalized_dup, 0);
    infer_backend be = doubler_backend();
    infer_server_options *o = NULL;
    infer_server *s = NULL;
    /* Options that never make a server finalize their backend when freed. */
    CHECK_OK(infer_server_options_new(&o));
    CHECK_OK(infer_server_options_register_backend(o, "doubler_backend", &be, &finalized));
    infer_server_options_free(o);
    CHECK(atomic_load(&finalized) == 1, "finalize ran %d times", atomic_load(&finalized));

    atomic_store(&finalized, 0);
    CHECK_OK(infer_server_options_new(&o));
    CHECK_OK(infer_server_options_set_gpu(o, INFER_GPU_OFF));
    CHECK_OK(infer_server_options_register_backend(o, "doubler_backend", &be, &finalized));
    CHECK_STATUS(infer_server_options_register_backend(o, "doubler_backend", &be, &finalized_dup),
                 INFER_STATUS_ALREADY_EXISTS);
    CHECK_OK(infer_server_new(o, &s));
    infer_server_options_free(o);
    CHECK_OK(infer_server_load_model(s, "doubler", DOUBLER, NULL));
    struct slot sl;
    enqueue_doubler(s, 1, &sl);
    CHECK(harness_wait_at_least(&sl.finals, 1, 10.0));
    CHECK(atomic_load(&sl.status) == INFER_STATUS_OK && sl.out[1] == 4);
    CHECK(atomic_load(&finalized) == 0, "finalize ran while the server still uses the backend");
    infer_server_free(s);
    CHECK(atomic_load(&finalized) == 1, "finalize ran %d times", atomic_load(&finalized));
    CHECK(atomic_load(&finalized_dup) == 0, "a refused registration was finalized");
}

/* ---- pause / resume, queue limits, cancel, shutdown ---- */

static const char *ADD_SUB_SMALL_BATCH =
    "backend: \"add_sub\"\n"
    "max_batch_size: 4\n"
    "input [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },\n"
    "        { name: \"INPUT1\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n"
    "output [ { name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },\n"
    "         { name: \"OUTPUT1\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n"
    "dynamic_batching { max_queue_delay_microseconds: 0 %s }\n"
    "parameters { key: \"execute_delay_us\" value { string_value: \"2000\" } }\n";

static infer_server *server_with(const char *extra) {
    char config[2048];
    snprintf(config, sizeof config, ADD_SUB_SMALL_BATCH, extra);
    infer_server *s = new_server();
    CHECK_OK(infer_server_load_model(s, "add_sub", config, NULL));
    return s;
}

struct counted {
    atomic_int finals;
    atomic_int calls;
    atomic_int last_status;
};

static void counted_response(void *ud, infer_response *resp, uint32_t flags) {
    struct counted *c = ud;
    atomic_fetch_add(&c->calls, 1);
    atomic_store(&c->last_status, (int)infer_response_status(resp));
    infer_response_free(resp);
    if (flags & INFER_RESPONSE_FLAG_FINAL) atomic_fetch_add(&c->finals, 1);
}

static const float A[4] = {1, 2, 3, 4}, B[4] = {4, 3, 2, 1};

static infer_status enqueue_counted(infer_server *s, struct counted *c, uint64_t *id) {
    atomic_store(&c->last_status, -1);
    return infer_server_enqueue(s, add_sub_request(s, "add_sub", A, B), counted_response, c, id);
}

static int all_finals_once(struct counted *c, int n, double timeout_s) {
    double end = harness_now() + timeout_s;
    for (int i = 0; i < n; i++)
        while (atomic_load(&c[i].finals) < 1)
            if (harness_now() > end) return 0;
            else harness_sleep_ms(1);
    harness_sleep_ms(20); /* a second FINAL would arrive now */
    for (int i = 0; i < n; i++)
        if (atomic_load(&c[i].finals) != 1 || atomic_load(&c[i].calls) != 1) return 0;
    return 1;
}

void test_pause_and_batch_sizes(void) {
    infer_server *s = server_with("");
    struct counted c[10] = {0};
    CHECK_OK(infer_server_pause_model(s, "add_sub"));
    for (int i = 0; i < 10; i++) CHECK_OK(enqueue_counted(s, &c[i], NULL));
    harness_sleep_ms(20);
    int early = 0;
    for (int i = 0; i < 10; i++) early += atomic_load(&c[i].finals);
    CHECK(early == 0, "%d requests ran while the model was paused", early);
    char *json = NULL;
    CHECK_OK(infer_server_statistics_json(s, NULL, &json));
    CHECK(json && strstr(json, "\"pending\":10"), "%s", json ? json : "(null)");
    infer_string_free(json);
    CHECK_OK(infer_server_resume_model(s, "add_sub"));
    CHECK(all_finals_once(c, 10, 10.0));
    for (int i = 0; i < 10; i++) CHECK(atomic_load(&c[i].last_status) == INFER_STATUS_OK);
    CHECK_OK(infer_server_statistics_json(s, "add_sub", &json));
    /* 10 queued requests, max batch 4: 4 + 4 + 2. */
    CHECK(json && strstr(json, "\"batch_sizes\":[{\"size\":2,\"count\":1},{\"size\":4,\"count\":2}]") &&
              strstr(json, "\"execution_count\":3") && strstr(json, "\"inference_count\":10"),
          "%s", json ? json : "(null)");
    infer_string_free(json);
    CHECK_STATUS(infer_server_pause_model(s, "nope"), INFER_STATUS_NOT_FOUND);
    infer_server_free(s);
}

void test_queue_full(void) {
    infer_server *s = server_with("default_queue_policy { max_queue_size: 3 }");
    struct counted c[4] = {0};
    CHECK_OK(infer_server_pause_model(s, "add_sub"));
    for (int i = 0; i < 3; i++) CHECK_OK(enqueue_counted(s, &c[i], NULL));
    CHECK_STATUS(enqueue_counted(s, &c[3], NULL), INFER_STATUS_RESOURCE_EXHAUSTED);
    CHECK(strstr(infer_last_error_message(), "add_sub") != NULL, "%s", infer_last_error_message());
    CHECK_OK(infer_server_resume_model(s, "add_sub"));
    CHECK(all_finals_once(c, 3, 10.0));
    CHECK(atomic_load(&c[3].calls) == 0, "a refused request got %d callbacks", atomic_load(&c[3].calls));
    /* Room again once the queue drained. */
    CHECK_OK(enqueue_counted(s, &c[3], NULL));
    CHECK(all_finals_once(&c[3], 1, 10.0));
    infer_server_free(s);
}

void test_cancel_queued(void) {
    infer_server *s = server_with("");
    struct counted c[3] = {0};
    uint64_t id[3] = {0};
    CHECK_OK(infer_server_pause_model(s, "add_sub"));
    for (int i = 0; i < 3; i++) CHECK_OK(enqueue_counted(s, &c[i], &id[i]));
    CHECK(id[0] != 0 && id[0] != id[1] && id[1] != id[2]);
    CHECK_OK(infer_server_cancel(s, id[1]));
    CHECK(all_finals_once(&c[1], 1, 5.0));
    CHECK(atomic_load(&c[1].last_status) == INFER_STATUS_CANCELLED, "status %d", atomic_load(&c[1].last_status));
    CHECK(atomic_load(&c[0].finals) == 0 && atomic_load(&c[2].finals) == 0);
    CHECK_STATUS(infer_server_cancel(s, id[1]), INFER_STATUS_NOT_FOUND);
    CHECK_STATUS(infer_server_cancel(s, 987654321), INFER_STATUS_NOT_FOUND);
    CHECK_OK(infer_server_resume_model(s, "add_sub"));
    CHECK(all_finals_once(c, 3, 10.0));
    CHECK(atomic_load(&c[0].last_status) == INFER_STATUS_OK && atomic_load(&c[2].last_status) == INFER_STATUS_OK);
    CHECK_STATUS(infer_server_cancel(s, id[0]), INFER_STATUS_NOT_FOUND);
    infer_server_free(s);
}

void test_shutdown_with_queued_requests(void) {
    enum { N = 40 };
    infer_server *s = server_with("");
    struct counted c[N] = {0};
    CHECK_OK(infer_server_pause_model(s, "add_sub"));
    for (int i = 0; i < N; i++) CHECK_OK(enqueue_counted(s, &c[i], NULL));
    infer_request *late = add_sub_request(s, "add_sub", A, B);
    CHECK_OK(infer_server_shutdown(s, 0));
    CHECK(all_finals_once(c, N, 0.0), "shutdown returned before every request had one FINAL");
    int ok = 0, cancelled = 0;
    for (int i = 0; i < N; i++) {
        ok += atomic_load(&c[i].last_status) == INFER_STATUS_OK;
        cancelled += atomic_load(&c[i].last_status) == INFER_STATUS_CANCELLED;
    }
    CHECK(ok + cancelled == N, "%d OK + %d CANCELLED of %d", ok, cancelled, N);
    printf("   shutdown: %d finished, %d cancelled\n", ok, cancelled);
    struct counted after = {0};
    CHECK_STATUS(infer_server_enqueue(s, late, counted_response, &after, NULL), INFER_STATUS_UNAVAILABLE);
    CHECK_OK(infer_server_shutdown(s, 0)); /* idempotent */
    infer_server_free(s);
    CHECK(atomic_load(&after.calls) == 0);
}

/* ---- borrowed inputs are released exactly once ---- */

static void count_release(void *ud) { atomic_fetch_add((atomic_int *)ud, 1); }

static infer_request *borrowed_request(infer_server *s, const float *a, const float *b, atomic_int *rel) {
    static const int64_t shape[2] = {1, 4};
    infer_request *r = NULL;
    CHECK_OK(infer_request_new(s, "add_sub", -1, &r));
    CHECK_OK(infer_request_add_input_borrowed(r, "INPUT0", INFER_DATATYPE_FP32, shape, 2, a, 16,
                                              INFER_MEMORY_CPU, 0, count_release, &rel[0]));
    CHECK_OK(infer_request_add_input_borrowed(r, "INPUT1", INFER_DATATYPE_FP32, shape, 2, b, 16,
                                              INFER_MEMORY_CPU_PINNED, 0, count_release, &rel[1]));
    return r;
}

void test_borrowed_inputs(void) {
    static const int64_t shape[2] = {1, 4};
    infer_server *s = server_with("");
    atomic_int rel[10];
    for (int i = 0; i < 10; i++) atomic_init(&rel[i], 0);

    /* Enqueued: released once, and the result is right. */
    struct counted c = {0};
    uint64_t id = 0;
    CHECK_OK(infer_server_enqueue(s, borrowed_request(s, A, B, &rel[0]), counted_response, &c, &id));
    CHECK(all_finals_once(&c, 1, 10.0) && atomic_load(&c.last_status) == INFER_STATUS_OK);
    /* infer_server_infer. */
    infer_response *resp = NULL;
    CHECK_OK(infer_server_infer(s, borrowed_request(s, A, B, &rel[2]), &resp));
    CHECK(expect_add_sub(resp, A, B));
    infer_response_free(resp);
    /* Freed without enqueueing. */
    infer_request_free(borrowed_request(s, A, B, &rel[4]));
    /* Refused by enqueue (NULL callback): enqueue took it, so it is released. */
    CHECK_STATUS(infer_server_enqueue(s, borrowed_request(s, A, B, &rel[6]), NULL, NULL, NULL),
                 INFER_STATUS_INVALID_ARGUMENT);
    /* A failed add is not taken: release is never called for it. */
    infer_request *r = NULL;
    CHECK_OK(infer_request_new(s, "add_sub", -1, &r));
    CHECK_STATUS(infer_request_add_input_borrowed(r, "INPUT0", INFER_DATATYPE_FP32, shape, 2, A, 12,
                                                  INFER_MEMORY_CPU, 0, count_release, &rel[8]),
                 INFER_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(infer_request_add_input_borrowed(r, "INPUT0", INFER_DATATYPE_FP32, shape, 2, A, 16,
                                                  INFER_MEMORY_GPU, 0, count_release, &rel[8]),
                 INFER_STATUS_UNAVAILABLE); /* new_server() has GPU use OFF */
    CHECK(strstr(infer_last_error_message(), "OFF") != NULL, "%s", infer_last_error_message());
    /* Outputs: host memory (pinned is served as host memory); GPU memory needs a GPU. */
    CHECK_OK(infer_request_set_output_memory(r, INFER_MEMORY_CPU, 0));
    CHECK_OK(infer_request_set_output_memory(r, INFER_MEMORY_CPU_PINNED, 0));
    CHECK_STATUS(infer_request_set_output_memory(r, INFER_MEMORY_GPU, 0), INFER_STATUS_UNAVAILABLE);
    CHECK_STATUS(infer_request_set_output_memory(r, 5, 0), INFER_STATUS_INVALID_ARGUMENT);
    infer_request_free(r);
    for (int i = 0; i < 8; i++) CHECK(harness_wait_at_least(&rel[i], 1, 5.0), "buffer %d never released", i);
    infer_server_free(s);
    for (int i = 0; i < 8; i++) CHECK(atomic_load(&rel[i]) == 1, "buffer %d released %d times", i, atomic_load(&rel[i]));
    CHECK(atomic_load(&rel[8]) == 0, "a buffer that was not taken was released");
}

/* A decoupled backend: for IN = [n], sends n responses OUT = [k] and then an empty
 * FINAL, all from inside execute through the request's sender. */
static uint32_t streamer_execute(void *state, infer_batch *b) {
    (void)state;
    for (uint32_t i = 0; i < infer_batch_request_count(b); i++) {
        const int64_t *shape = NULL;
        size_t ndim = 0;
        const void *data = NULL;
        uint32_t first = 99, rows = 0;
        infer_status st = infer_batch_request_input(b, i, "IN", NULL, &shape, &ndim, &data, NULL);
        if (st != INFER_STATUS_OK) return st;
        if (infer_batch_request_rows(b, i, &first, &rows) != INFER_STATUS_OK || rows != 1) return INFER_STATUS_INTERNAL;
        infer_response_sender *snd = NULL;
        st = infer_batch_response_sender(b, i, &snd);
        if (st != INFER_STATUS_OK) return st;
        int32_t n = *(const int32_t *)data;
        for (int32_t k = 0; k < n; k++) {
            const int64_t out_shape[2] = {1, 1};
            void *out = NULL;
            st = infer_response_sender_output(snd, "OUT", out_shape, 2, &out);
            if (st != INFER_STATUS_OK) break;
            *(int32_t *)out = k;
            st = infer_response_sender_send(snd, 0);
            if (st != INFER_STATUS_OK) break;
        }
        if (st != INFER_STATUS_OK) {
            infer_response_sender_send_error(snd, st, infer_last_error_message());
            continue;
        }
        infer_response_sender_send(snd, INFER_RESPONSE_FLAG_FINAL);
    }
    return INFER_STATUS_OK;
}

struct stream_seen {
    atomic_int responses;
    atomic_int finals;
    atomic_int last_value;
    atomic_int final_outputs;
};

static void stream_response(void *ud, infer_response *resp, uint32_t flags) {
    struct stream_seen *seen = ud;
    const void *data = NULL;
    size_t bytes = 0;
    if (infer_response_output_by_name(resp, "OUT", NULL, NULL, NULL, &data, &bytes) == INFER_STATUS_OK &&
        bytes == 4)
        atomic_store(&seen->last_value, *(const int32_t *)data);
    if (flags & INFER_RESPONSE_FLAG_FINAL) {
        atomic_store(&seen->final_outputs, (int)infer_response_output_count(resp));
        atomic_fetch_add(&seen->finals, 1);
    } else {
        atomic_fetch_add(&seen->responses, 1);
    }
    infer_response_free(resp);
}

void test_decoupled_backend(void) {
    infer_server *s = new_server();
    infer_backend be;
    memset(&be, 0, sizeof be);
    be.struct_size = sizeof be;
    be.execute = streamer_execute;
    CHECK_OK(infer_server_register_backend(s, "streamer", &be, NULL));
    CHECK_OK(infer_server_load_model(s, "stream",
                                     "backend: \"streamer\" max_batch_size: 4\n"
                                     "input [ { name: \"IN\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
                                     "output [ { name: \"OUT\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
                                     "model_transaction_policy { decoupled: true }\n",
                                     NULL));
    struct stream_seen seen;
    atomic_init(&seen.responses, 0);
    atomic_init(&seen.finals, 0);
    atomic_init(&seen.last_value, -1);
    atomic_init(&seen.final_outputs, -1);
    const int64_t shape[2] = {1, 1};
    const int32_t n = 3;
    infer_request *r = NULL;
    CHECK_OK(infer_request_new(s, "stream", -1, &r));
    CHECK_OK(infer_request_add_input(r, "IN", INFER_DATATYPE_INT32, shape, 2, &n, sizeof n));
    CHECK_OK(infer_server_enqueue(s, r, stream_response, &seen, NULL));
    CHECK(harness_wait_at_least(&seen.finals, 1, 10.0));
    CHECK(atomic_load(&seen.responses) == 3, "%d responses", atomic_load(&seen.responses));
    CHECK(atomic_load(&seen.last_value) == 2, "last value %d", atomic_load(&seen.last_value));
    CHECK(atomic_load(&seen.final_outputs) == 0, "the FINAL has %d outputs", atomic_load(&seen.final_outputs));
    CHECK(atomic_load(&seen.finals) == 1);
    CHECK_STATUS(infer_response_sender_send(NULL, 0), INFER_STATUS_INVALID_ARGUMENT);
    CHECK(!infer_response_sender_is_cancelled(NULL));
    infer_server_free(s);
}
