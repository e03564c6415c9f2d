/*
 * C API tests of sequence batching: one sequence through the built-in accumulator,
 * string correlation IDs, the errors enqueue reports, and the control tensors
 * (START/END/READY/CORRID, padding rows included) as a C custom backend sees them.
 */
#include "harness.h"

#include <inttypes.h>

#define F_START INFER_REQUEST_FLAG_SEQUENCE_START
#define F_END INFER_REQUEST_FLAG_SEQUENCE_END

static const char *ACC_PBTXT =
    "name: \"%s\"\n"
    "backend: \"%s\"\n"
    "max_batch_size: %d\n"
    "input [ { name: \"INPUT\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
    "output [ { name: \"OUTPUT\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
    "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    "sequence_batching {\n"
    "  max_sequence_idle_microseconds: 5000000\n"
    "  direct { }\n"
    "  control_input [\n"
    "    { name: \"START\" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },\n"
    "    { name: \"READY\" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }%s\n"
    "  ]\n"
    "}\n";

static const char *END_CORRID_U64 =
    ",\n    { name: \"END\" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },\n"
    "    { name: \"CORRID\" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }";

static const char *END_CORRID_STRING =
    ",\n    { name: \"END\" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },\n"
    "    { name: \"CORRID\" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }";

static infer_status load_seq_model(infer_server *s, const char *name, const char *backend,
                                   int max_batch, const char *extra_controls) {
    char config[4096];
    snprintf(config, sizeof config, ACC_PBTXT, name, backend, max_batch, extra_controls);
    return infer_server_load_model(s, name, config, NULL);
}

/* A request of one row; `sid` non-NULL sets a string ID, else `id` (0 = none). Only
 * failures are counted, so the check totals do not grow with request counts. */
static infer_request *seq_request(infer_server *s, const char *model, uint64_t id,
                                  const char *sid, uint32_t flags, int32_t v) {
    static const int64_t shape[2] = {1, 1};
    infer_request *r = NULL;
    infer_status st = infer_request_new(s, model, -1, &r);
    if (st == INFER_STATUS_OK)
        st = infer_request_add_input(r, "INPUT", INFER_DATATYPE_INT32, shape, 2, &v, sizeof v);
    if (st == INFER_STATUS_OK)
        st = sid ? infer_request_set_correlation_id_str(r, sid)
                 : infer_request_set_correlation_id(r, id);
    if (st == INFER_STATUS_OK) st = infer_request_set_flags(r, flags);
    if (st != INFER_STATUS_OK)
        CHECK(st == INFER_STATUS_OK, "sequence request for '%s': %s: %s", model,
              infer_status_string(st), infer_last_error_message());
    return r;
}

/* Runs one request with infer_server_infer; returns OUTPUT[0] or INT32_MIN on failure. */
static int32_t seq_infer(infer_server *s, const char *model, uint64_t id, const char *sid,
                         uint32_t flags, int32_t v, uint64_t *corr_out) {
    infer_response *resp = NULL;
    int32_t out = INT32_MIN;
    infer_status st = infer_server_infer(s, seq_request(s, model, id, sid, flags, v), &resp);
    if (st != INFER_STATUS_OK) {
        CHECK(st == INFER_STATUS_OK, "infer: %s: %s", infer_status_string(st), infer_last_error_message());
        return out;
    }
    const void *data = NULL;
    size_t bytes = 0, ndim = 0;
    const int64_t *shape = NULL;
    if (infer_response_status(resp) != INFER_STATUS_OK) {
        const char *e = infer_response_error_message(resp);
        CHECK(0, "response: %s", e ? e : "");
    } else if (infer_response_output_by_name(resp, "OUTPUT", NULL, &shape, &ndim, &data, &bytes) ==
                   INFER_STATUS_OK &&
               bytes == 4 && ndim == 2 && shape[0] == 1 && shape[1] == 1) {
        memcpy(&out, data, 4);
    }
    if (corr_out) *corr_out = infer_response_correlation_id(resp);
    infer_response_free(resp);
    return out;
}

struct seq_slot {
    atomic_int finals;
    atomic_int calls;
    atomic_int status;
    int32_t out;
    uint64_t corr;
};

static void seq_response(void *ud, infer_response *resp, uint32_t flags) {
    struct seq_slot *sl = ud;
    const void *data = NULL;
    size_t bytes = 0;
    atomic_fetch_add(&sl->calls, 1);
    atomic_store(&sl->status, (int)infer_response_status(resp));
    if (infer_response_output_by_name(resp, "OUTPUT", NULL, NULL, NULL, &data, &bytes) == INFER_STATUS_OK &&
        bytes == 4)
        memcpy(&sl->out, data, 4);
    sl->corr = infer_response_correlation_id(resp);
    infer_response_free(resp);
    if (flags & INFER_RESPONSE_FLAG_FINAL) atomic_fetch_add(&sl->finals, 1);
}

static int wait_slots(struct seq_slot *sl, int n, double timeout_s) {
    for (int i = 0; i < n; i++)
        if (!harness_wait_at_least(&sl[i].finals, 1, timeout_s)) return 0;
    harness_sleep_ms(20); /* a second FINAL would arrive now */
    for (int i = 0; i < n; i++)
        if (atomic_load(&sl[i].finals) != 1 || atomic_load(&sl[i].calls) != 1) return 0;
    return 1;
}

/* ---- one sequence ---- */

void test_sequence_single(void) {
    infer_server *s = new_server();
    CHECK_OK(load_seq_model(s, "acc", "accumulator", 4, ""));
    const int32_t vals[4] = {1, 2, 3, 4};
    int32_t sum = 0;
    for (int k = 0; k < 4; k++) {
        uint32_t flags = (k == 0 ? F_START : 0) | (k == 3 ? F_END : 0);
        uint64_t corr = 0;
        sum += vals[k];
        int32_t got = seq_infer(s, "acc", 7, NULL, flags, vals[k], &corr);
        CHECK(got == sum, "request %d: %d, expected %d", k, got, sum);
        CHECK(corr == 7, "correlation ID %" PRIu64, corr);
    }
    /* The same ID with START after END: a new sequence. */
    CHECK(seq_infer(s, "acc", 7, NULL, F_START | F_END, 40, NULL) == 40);
    char *json = NULL;
    CHECK_OK(infer_server_statistics_json(s, "acc", &json));
    CHECK(json && strstr(json, "\"batch_sizes\":[{\"size\":1,\"count\":5}]") &&
              strstr(json, "\"inference_count\":5") && strstr(json, "\"execution_count\":5"),
          "%s", json ? json : "(null)");
    infer_string_free(json);
    infer_server_free(s);
}

/* ---- string correlation IDs: two sequences in two slots, queued while paused ---- */

void test_sequence_string_ids(void) {
    infer_server *s = new_server();
    CHECK_OK(load_seq_model(s, "acc", "accumulator", 2, ""));
    CHECK_OK(infer_server_pause_model(s, "acc"));
    struct seq_slot sl[6];
    memset(sl, 0, sizeof sl);
    const char *ids[2] = {"alpha", "alphabet"};
    const int32_t vals[2][3] = {{1, 2, 3}, {10, 20, 30}};
    for (int k = 0; k < 3; k++)
        for (int q = 0; q < 2; q++) {
            uint32_t flags = (k == 0 ? F_START : 0) | (k == 2 ? F_END : 0);
            CHECK_OK(infer_server_enqueue(s, seq_request(s, "acc", 0, ids[q], flags, vals[q][k]),
                                          seq_response, &sl[k * 2 + q], NULL));
        }
    harness_sleep_ms(20);
    CHECK(atomic_load(&sl[0].finals) == 0, "a paused model ran");
    CHECK_OK(infer_server_resume_model(s, "acc"));
    CHECK(wait_slots(sl, 6, 30.0), "every request gets exactly one FINAL");
    const int32_t want[6] = {1, 10, 3, 30, 6, 60};
    for (int i = 0; i < 6; i++) {
        CHECK(atomic_load(&sl[i].status) == INFER_STATUS_OK && sl[i].out == want[i],
              "request %d: status %d, %d, expected %d", i, atomic_load(&sl[i].status), sl[i].out, want[i]);
        CHECK(sl[i].corr == 0, "a string ID reads as numeric %" PRIu64, sl[i].corr);
    }
    char *json = NULL;
    CHECK_OK(infer_server_statistics_json(s, "acc", &json));
    CHECK(json && strstr(json, "\"batch_sizes\":[{\"size\":2,\"count\":3}]"), "%s", json ? json : "(null)");
    infer_string_free(json);
    infer_server_free(s);
}

/* ---- errors reported by enqueue ---- */

static void check_refused(infer_server *s, infer_request *r, const char *word, const char *what) {
    struct seq_slot sl;
    memset(&sl, 0, sizeof sl);
    infer_status st = infer_server_enqueue(s, r, seq_response, &sl, NULL);
    const char *msg = infer_last_error_message();
    CHECK(st == INFER_STATUS_INVALID_ARGUMENT, "%s: %s: %s", what, infer_status_string(st), msg);
    CHECK(strstr(msg, "acc") != NULL, "%s: message does not name the model: %s", what, msg);
    if (word) CHECK(strstr(msg, word) != NULL, "%s: message does not name %s: %s", what, word, msg);
    if (st == INFER_STATUS_OK) harness_wait_at_least(&sl.finals, 1, 10.0);
    CHECK(atomic_load(&sl.calls) == 0, "%s: a refused request was answered", what);
}

void test_sequence_errors(void) {
    infer_server *s = new_server();
    CHECK_OK(load_seq_model(s, "acc", "accumulator", 4, ""));
    check_refused(s, seq_request(s, "acc", 0, NULL, F_START, 1), NULL, "no correlation ID");
    /* An empty string ID: refused by set_correlation_id_str or by enqueue. */
    infer_request *r = seq_request(s, "acc", 0, NULL, F_START, 1);
    infer_status st = infer_request_set_correlation_id_str(r, "");
    if (st == INFER_STATUS_OK) {
        check_refused(s, r, NULL, "empty string ID");
    } else {
        CHECK(st == INFER_STATUS_INVALID_ARGUMENT, "%s", infer_status_string(st));
        infer_request_free(r);
    }
    check_refused(s, seq_request(s, "acc", 51, NULL, 0, 1), "51", "no START");
    check_refused(s, seq_request(s, "acc", 0, "s-52", F_END, 1), "s-52", "END without START");

    /* Batch size 2 in a batching sequence model. */
    r = NULL;
    const int64_t shape2[2] = {2, 1};
    const int32_t two[2] = {1, 2};
    CHECK_OK(infer_request_new(s, "acc", -1, &r));
    CHECK_OK(infer_request_add_input(r, "INPUT", INFER_DATATYPE_INT32, shape2, 2, two, sizeof two));
    CHECK_OK(infer_request_set_correlation_id(r, 53));
    CHECK_OK(infer_request_set_flags(r, F_START));
    check_refused(s, r, "53", "batch size 2");

    /* After END the sequence is gone. */
    CHECK(seq_infer(s, "acc", 54, NULL, F_START, 5, NULL) == 5);
    CHECK(seq_infer(s, "acc", 54, NULL, F_END, 6, NULL) == 11);
    check_refused(s, seq_request(s, "acc", 54, NULL, 0, 1), "54", "after END");
    CHECK(seq_infer(s, "acc", 54, NULL, F_START | F_END, 2, NULL) == 2);

    /* Unknown flag bits; a string ID over 128 bytes. */
    CHECK_OK(infer_request_new(s, "acc", -1, &r));
    CHECK_STATUS(infer_request_set_flags(r, 4), INFER_STATUS_INVALID_ARGUMENT);
    char longid[INFER_MAX_CORRELATION_ID_BYTES + 2];
    memset(longid, 'x', sizeof longid - 1);
    longid[sizeof longid - 1] = '\0';
    st = infer_request_set_correlation_id_str(r, longid);
    if (st == INFER_STATUS_OK) {
        CHECK_OK(infer_request_set_flags(r, F_START));
        check_refused(s, r, NULL, "129-byte ID");
    } else {
        CHECK(st == INFER_STATUS_INVALID_ARGUMENT, "%s", infer_status_string(st));
        infer_request_free(r);
    }
    longid[INFER_MAX_CORRELATION_ID_BYTES] = '\0'; /* exactly 128 bytes: fine */
    CHECK(seq_infer(s, "acc", 0, longid, F_START | F_END, 3, NULL) == 3);

    /* A string ID for a model whose CORRID control is UINT64. */
    CHECK_OK(load_seq_model(s, "acc_u64", "accumulator", 4, END_CORRID_U64));
    struct seq_slot sl;
    memset(&sl, 0, sizeof sl);
    st = infer_server_enqueue(s, seq_request(s, "acc_u64", 0, "abc", F_START, 1), seq_response, &sl, NULL);
    const char *msg = infer_last_error_message();
    CHECK(st == INFER_STATUS_INVALID_ARGUMENT && strstr(msg, "UINT64") != NULL, "%s: %s",
          infer_status_string(st), msg);
    CHECK(seq_infer(s, "acc_u64", 99, NULL, F_START | F_END, 8, NULL) == 8);
    infer_server_free(s);
}

/* ---- control tensors seen by a C custom backend (OUTPUT = INPUT) ---- */

#define REC_BATCHES 16
#define REC_ROWS 8

struct rec_batch {
    uint32_t size;
    int layout_ok;
    int32_t start[REC_ROWS], end[REC_ROWS], ready[REC_ROWS], input[REC_ROWS];
    char corr[REC_ROWS][40];
};

static struct rec_batch rec[REC_BATCHES];
static atomic_int rec_n;

/* Reads an INT32 [rows, 1] tensor into out[]; 0 if absent or shaped otherwise. */
static int read_i32(infer_batch *b, const char *name, uint32_t rows, int32_t *out) {
    infer_datatype dt = 0;
    const int64_t *shape = NULL;
    size_t ndim = 0, bytes = 0;
    const void *data = NULL;
    if (infer_batch_input(b, name, &dt, &shape, &ndim, &data, &bytes) != INFER_STATUS_OK) return 0;
    if (dt != INFER_DATATYPE_INT32 || ndim != 2 || shape[0] != rows || shape[1] != 1 || bytes != rows * 4)
        return 0;
    memcpy(out, data, bytes);
    return 1;
}

static int read_corrid(infer_batch *b, uint32_t rows, char (*out)[40]) {
    infer_datatype dt = 0;
    const int64_t *shape = NULL;
    size_t ndim = 0, bytes = 0;
    const void *data = NULL;
    if (infer_batch_input(b, "CORRID", &dt, &shape, &ndim, &data, &bytes) != INFER_STATUS_OK) return 0;
    if (ndim != 2 || shape[0] != rows || shape[1] != 1) return 0;
    const unsigned char *p = data;
    if (dt == INFER_DATATYPE_UINT64) {
        if (bytes != rows * 8) return 0;
        for (uint32_t i = 0; i < rows; i++) {
            uint64_t v;
            memcpy(&v, p + 8 * i, 8);
            snprintf(out[i], 40, "%" PRIu64, v);
        }
        return 1;
    }
    if (dt != INFER_DATATYPE_BYTES) return 0;
    size_t off = 0;
    for (uint32_t i = 0; i < rows; i++) {
        uint32_t n;
        if (off + 4 > bytes) return 0;
        memcpy(&n, p + off, 4);
        if (off + 4 + n > bytes || n >= 40) return 0;
        memcpy(out[i], p + off + 4, n);
        out[i][n] = '\0';
        off += 4 + n;
    }
    return off == bytes;
}

static uint32_t rec_execute(void *state, infer_batch *b) {
    (void)state;
    int n = atomic_load(&rec_n);
    uint32_t rows = infer_batch_size(b);
    if (n >= REC_BATCHES || rows > REC_ROWS) return INFER_STATUS_INTERNAL;
    struct rec_batch *rb = &rec[n];
    memset(rb, 0, sizeof *rb);
    rb->size = rows;
    rb->layout_ok = read_i32(b, "START", rows, rb->start) && read_i32(b, "END", rows, rb->end) &&
                    read_i32(b, "READY", rows, rb->ready) && read_i32(b, "INPUT", rows, rb->input) &&
                    read_corrid(b, rows, rb->corr);
    void *out = NULL;
    int64_t oshape[2] = {rows, 1};
    uint32_t st = infer_batch_output(b, "OUTPUT", oshape, 2, &out);
    if (st != INFER_STATUS_OK) return st;
    memcpy(out, rb->input, rows * 4);
    atomic_store(&rec_n, n + 1);
    return INFER_STATUS_OK;
}

/* A (3 requests) in slot 0, B (1) in slot 1, C (2) in slot 2, queued round-robin while
 * paused: batches [A B C], [A pad C], [A]. */
static void check_controls(const char *corrid_controls, const char *a, const char *bb, const char *c,
                           const char *pad) {
    infer_server *s = new_server();
    infer_backend be = {0};
    be.struct_size = sizeof be;
    be.execute = rec_execute;
    CHECK_OK(infer_server_register_backend(s, "seq_recorder", &be, NULL));
    CHECK_OK(load_seq_model(s, "acc", "seq_recorder", 4, corrid_controls));
    int numeric = strcmp(pad, "0") == 0;
    atomic_store(&rec_n, 0);
    CHECK_OK(infer_server_pause_model(s, "acc"));
    struct {
        const char *id;
        uint32_t flags;
        int32_t v;
    } plan[6] = {{a, F_START, 11},  {bb, F_START | F_END, 21}, {c, F_START, 31},
                 {a, 0, 12},        {c, F_END, 32},            {a, F_END, 13}};
    struct seq_slot sl[6];
    memset(sl, 0, sizeof sl);
    for (int i = 0; i < 6; i++) {
        uint64_t id = numeric ? strtoull(plan[i].id, NULL, 10) : 0;
        infer_request *r = seq_request(s, "acc", id, numeric ? NULL : plan[i].id, plan[i].flags, plan[i].v);
        CHECK_OK(infer_server_enqueue(s, r, seq_response, &sl[i], NULL));
    }
    CHECK_OK(infer_server_resume_model(s, "acc"));
    CHECK(wait_slots(sl, 6, 30.0), "every request gets exactly one FINAL");
    for (int i = 0; i < 6; i++)
        CHECK(atomic_load(&sl[i].status) == INFER_STATUS_OK && sl[i].out == plan[i].v,
              "request %d: status %d out %d", i, atomic_load(&sl[i].status), sl[i].out);
    CHECK(atomic_load(&rec_n) == 3, "%d batches", atomic_load(&rec_n));
    static const struct {
        uint32_t size;
        int32_t start[3], end[3], ready[3], input[3];
        int corr[3]; /* 0 = a, 1 = b, 2 = c, -1 = padding */
    } want[3] = {
        {3, {1, 1, 1}, {0, 1, 0}, {1, 1, 1}, {11, 21, 31}, {0, 1, 2}},
        {3, {0, 0, 0}, {0, 0, 1}, {1, 0, 1}, {12, 0, 32}, {0, -1, 2}},
        {1, {0}, {1}, {1}, {13}, {0}},
    };
    const char *names[3] = {a, bb, c};
    for (int i = 0; i < 3 && i < atomic_load(&rec_n); i++) {
        struct rec_batch *rb = &rec[i];
        CHECK(rb->layout_ok, "batch %d: control tensors missing or not INT32/[rows,1]", i);
        CHECK(rb->size == want[i].size, "batch %d: %u rows", i, rb->size);
        for (uint32_t row = 0; row < rb->size && row < want[i].size; row++) {
            const char *wc = want[i].corr[row] < 0 ? pad : names[want[i].corr[row]];
            CHECK(rb->start[row] == want[i].start[row] && rb->end[row] == want[i].end[row] &&
                      rb->ready[row] == want[i].ready[row] && rb->input[row] == want[i].input[row] &&
                      strcmp(rb->corr[row], wc) == 0,
                  "batch %d row %u: START %d END %d READY %d INPUT %d CORRID '%s' (expected %d %d %d %d '%s')", i,
                  row, rb->start[row], rb->end[row], rb->ready[row], rb->input[row], rb->corr[row],
                  want[i].start[row], want[i].end[row], want[i].ready[row], want[i].input[row], wc);
        }
    }
    infer_server_free(s);
}

void test_sequence_controls(void) {
    check_controls(END_CORRID_U64, "18446744073709551614", "22", "33", "0");
    check_controls(END_CORRID_STRING, "seq-a", "b", "sequence-c", "");
}
