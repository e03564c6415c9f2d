/* Serves the shipped model repository (models/) on the CPU: every model in it is loaded
 * at start-up (the ONNX models run with the built-in ONNX backend), then each is used
 * once and its answer checked:
 *   add_sub           sums and differences, exactly;
 *   mlp               a batch of 3 rows equals the 3 rows sent one by one;
 *   accumulator_onnx  a sequence (START ... END) gives running sums;
 *   image_classifier  the ensemble preprocess -> cnn -> postprocess on synthetic images:
 *                     probabilities sum to 1 and LABEL is their argmax.
 * Usage: repository_demo [path/to/models]   (default: the repository this was built from)
 * Exits 1 on any error or wrong answer. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "infer.h"

#ifndef INFER_MODELS_DIR
#define INFER_MODELS_DIR "models"
#endif

#define TRY(call)                                                                   \
    do {                                                                            \
        if ((call) != INFER_STATUS_OK) {                                            \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call,    \
                    infer_last_error_message());                                    \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

static void fail(const char *what) {
    fprintf(stderr, "wrong answer: %s\n", what);
    exit(1);
}

/* Runs a request to completion; exits when the response carries an error. */
static infer_response *run(infer_server *s, infer_request *r) {
    infer_response *resp = NULL;
    TRY(infer_server_infer(s, r, &resp));
    if (infer_response_status(resp) != INFER_STATUS_OK) {
        fprintf(stderr, "%s: %s\n", infer_response_model_name(resp),
                infer_response_error_message(resp));
        exit(1);
    }
    return resp;
}

/* The output `name` of a response: its data, element count and datatype. */
static const void *output(const infer_response *resp, const char *name, size_t *count,
                          infer_datatype want) {
    infer_datatype dt;
    const int64_t *shape;
    size_t ndim, bytes;
    const void *data;
    TRY(infer_response_output_by_name(resp, name, &dt, &shape, &ndim, &data, &bytes));
    if (dt != want) fail(name);
    *count = bytes / infer_datatype_byte_size(dt);
    return data;
}

static void add_sub(infer_server *s) {
    float a[16], b[16];
    for (int i = 0; i < 16; i++) {
        a[i] = (float)i;
        b[i] = (float)(100 - i);
    }
    const int64_t shape[2] = {1, 16};
    infer_request *r;
    TRY(infer_request_new(s, "add_sub", -1, &r));
    TRY(infer_request_add_input(r, "INPUT0", INFER_DATATYPE_FP32, shape, 2, a, sizeof a));
    TRY(infer_request_add_input(r, "INPUT1", INFER_DATATYPE_FP32, shape, 2, b, sizeof b));
    infer_response *resp = run(s, r);
    size_t n0, n1;
    const float *sum = output(resp, "OUTPUT0", &n0, INFER_DATATYPE_FP32);
    const float *diff = output(resp, "OUTPUT1", &n1, INFER_DATATYPE_FP32);
    if (n0 != 16 || n1 != 16) fail("add_sub output size");
    for (int i = 0; i < 16; i++)
        if (sum[i] != a[i] + b[i] || diff[i] != a[i] - b[i]) fail("add_sub values");
    printf("add_sub:          OUTPUT0[0..3] = %g %g %g, OUTPUT1[0..3] = %g %g %g\n", sum[0],
           sum[1], sum[2], diff[0], diff[1], diff[2]);
    infer_response_free(resp);
}

static void mlp(infer_server *s) {
    enum { ROWS = 3, FEATURES = 64, CLASSES = 10 };
    static float x[ROWS][FEATURES];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < FEATURES; i++) x[r][i] = sinf((float)(r * FEATURES + i) * 0.37f);
    const int64_t batch_shape[2] = {ROWS, FEATURES};
    infer_request *r;
    TRY(infer_request_new(s, "mlp", -1, &r));
    TRY(infer_request_add_input(r, "FEATURES", INFER_DATATYPE_FP32, batch_shape, 2, x,
                                sizeof x));
    infer_response *batched = run(s, r);
    size_t n;
    const float *all = output(batched, "LOGITS", &n, INFER_DATATYPE_FP32);
    if (n != ROWS * CLASSES) fail("mlp batch output size");
    for (int row = 0; row < ROWS; row++) {
        const int64_t shape[2] = {1, FEATURES};
        TRY(infer_request_new(s, "mlp", -1, &r));
        TRY(infer_request_add_input(r, "FEATURES", INFER_DATATYPE_FP32, shape, 2, x[row],
                                    sizeof x[row]));
        infer_response *one = run(s, r);
        size_t m;
        const float *logits = output(one, "LOGITS", &m, INFER_DATATYPE_FP32);
        if (m != CLASSES) fail("mlp output size");
        for (int c = 0; c < CLASSES; c++)
            if (fabsf(logits[c] - all[row * CLASSES + c]) > 1e-4f * (1.0f + fabsf(logits[c])))
                fail("mlp: a batched row differs from the row alone");
        infer_response_free(one);
    }
    printf("mlp:              batch of %d rows = the rows one by one; row 0 LOGITS[0..3] = "
           "%.4f %.4f %.4f\n",
           ROWS, all[0], all[1], all[2]);
    infer_response_free(batched);
}

static void accumulator(infer_server *s) {
    const float values[5] = {1, 2, 3, 4, 5};
    float sum = 0;
    printf("accumulator_onnx: sequence 42:");
    for (int i = 0; i < 5; i++) {
        const int64_t shape[2] = {1, 1};
        infer_request *r;
        TRY(infer_request_new(s, "accumulator_onnx", -1, &r));
        TRY(infer_request_set_correlation_id(r, 42));
        uint32_t flags = (i == 0 ? INFER_REQUEST_FLAG_SEQUENCE_START : 0) |
                         (i == 4 ? INFER_REQUEST_FLAG_SEQUENCE_END : 0);
        TRY(infer_request_set_flags(r, flags));
        TRY(infer_request_add_input(r, "INPUT", INFER_DATATYPE_FP32, shape, 2, &values[i],
                                    sizeof values[i]));
        infer_response *resp = run(s, r);
        size_t n;
        const float *out = output(resp, "OUTPUT", &n, INFER_DATATYPE_FP32);
        sum += values[i];
        if (n != 1 || out[0] != sum) fail("accumulator running sum");
        printf(" %g", out[0]);
        infer_response_free(resp);
    }
    printf(" (running sums of 1..5)\n");
}

static void image_classifier(infer_server *s) {
    enum { SIDE = 28, CLASSES = 10 };
    for (int k = 0; k < 3; k++) {
        /* A synthetic image: a bar, a cross or a box. */
        static uint8_t img[SIDE][SIDE];
        memset(img, 0, sizeof img);
        for (int i = 4; i < 24; i++) {
            if (k == 0) img[i][14] = img[i][13] = 255;
            if (k == 1) img[i][14] = img[14][i] = 255;
            if (k == 2) img[4][i] = img[23][i] = img[i][4] = img[i][23] = 255;
        }
        const int64_t shape[3] = {1, SIDE, SIDE};
        infer_request *r;
        TRY(infer_request_new(s, "image_classifier", -1, &r));
        TRY(infer_request_add_input(r, "IMAGE", INFER_DATATYPE_UINT8, shape, 3, img,
                                    sizeof img));
        infer_response *resp = run(s, r);
        size_t np, nl;
        const float *probs = output(resp, "PROBABILITIES", &np, INFER_DATATYPE_FP32);
        const int64_t *label = output(resp, "LABEL", &nl, INFER_DATATYPE_INT64);
        if (np != CLASSES || nl != 1) fail("image_classifier output sizes");
        float total = 0;
        int best = 0;
        for (int c = 0; c < CLASSES; c++) {
            total += probs[c];
            if (probs[c] > probs[best]) best = c;
        }
        if (fabsf(total - 1.0f) > 1e-4f) fail("probabilities do not sum to 1");
        if (label[0] != best) fail("LABEL is not the argmax of PROBABILITIES");
        printf("image_classifier: image %d -> LABEL %lld (p = %.3f)\n", k, (long long)label[0],
               probs[best]);
        infer_response_free(resp);
    }
}

int main(int argc, char **argv) {
    const char *repo = argc > 1 ? argv[1] : INFER_MODELS_DIR;
    infer_server_options *opts;
    TRY(infer_server_options_new(&opts));
    TRY(infer_server_options_set_model_repository(opts, repo));
    infer_server *s;
    TRY(infer_server_new(opts, &s)); /* loads every model of the repository */
    infer_server_options_free(opts);
    printf("serving %s\n", repo);

    add_sub(s);
    mlp(s);
    accumulator(s);
    image_classifier(s);

    char *stats;
    TRY(infer_server_statistics_json(s, "image_classifier", &stats));
    printf("statistics of image_classifier: %.160s...\n", stats);
    infer_string_free(stats);
    TRY(infer_server_shutdown(s, 5000));
    infer_server_free(s);
    printf("all answers checked\n");
    return 0;
}
