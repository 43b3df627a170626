/*
 * dashboard.h: the live dashboard of `kvtier serve`: GET /dashboard (one
 * HTML page with its own JS and CSS, embedded in the binary at build time),
 * GET /dashboard/chart.js (Chart.js read at run time from Debian's
 * libjs-chart.js files, never fetched from the internet) and GET /events
 * (server-sent events: one `snapshot` event per second, the /stats document
 * without its request list, and one `request` event per finished request,
 * from the metrics ring).
 *
 * Cost: an event stream runs on its own connection thread (libmicrohttpd
 * thread per connection), never on the engine thread. It reads only what
 * the server keeps anyway: the snapshot is built at most once per second
 * and shared by every open stream, and the request ring is read under its
 * own mutex every 200 ms. Streams are bounded (max_streams; one more gets
 * 503 with Retry-After); a client that goes away ends its stream within
 * 200 ms, a client that stops reading within the connection timeout.
 *
 * Thread-safety: kvt_dash_handle may be called from any connection thread
 * at once; create, stop and destroy by the one thread that owns the server.
 */
#ifndef KVT_SERVER_DASHBOARD_H
#define KVT_SERVER_DASHBOARD_H

#include <microhttpd.h>

#include <jansson.h>

#include "metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Where Chart.js is read from unless KVTIER_CHARTJS names another file:
 * the UMD build of Debian's libjs-chart.js. */
#define KVT_DASH_CHARTJS_PATH "/usr/share/javascript/chart.js/chart.min.js"

/** Builds the snapshot document the streams send: a new reference the
 * callee owns after return (the dashboard decrefs it), or NULL when out of
 * memory. Called from connection threads, at most once per second. */
typedef json_t *(*kvt_dash_snapshot_fn)(void *ctx);

typedef struct kvt_dash_opts {
    kvt_srv_metrics *metrics;       /* borrowed: the request ring and the request counters; outlives the dashboard */
    kvt_dash_snapshot_fn snapshot;  /* the /stats document without "recent" */
    void *ctx;                      /* passed to snapshot */
    unsigned max_streams;           /* open /events streams at most; 0 = 16 */
    const char *chartjs_path;       /* NULL = $KVTIER_CHARTJS, else KVT_DASH_CHARTJS_PATH; copied */
} kvt_dash_opts;

typedef struct kvt_dash kvt_dash;

/** @param out caller frees with kvt_dash_destroy().
 * @return 0; KVT_EINVAL (no metrics or snapshot); KVT_ENOMEM. */
int kvt_dash_create(const kvt_dash_opts *o, kvt_dash **out);

/** Whether the dashboard answers `url`: /dashboard, /dashboard/ and
 * anything under it, /events. */
int kvt_dash_owns(const char *url);

/** Answers one GET the dashboard owns (kvt_dash_owns): the page and its
 * files (200, or 404 for an unknown file under /dashboard/ and for
 * Chart.js when its file cannot be read: the page then says so), or an
 * event stream (200 text/event-stream; 503 when max_streams are open or
 * the dashboard is stopping). A stream resumes after the `Last-Event-ID`
 * request header (the seq of the last request event seen), else begins
 * with the last 50 finished requests. Counts the request in the metrics
 * under `ep`.
 * @return what MHD_queue_response returned (MHD_NO when out of memory). */
enum MHD_Result kvt_dash_handle(kvt_dash *d, struct MHD_Connection *c, const char *url, kvt_srv_endpoint ep);

/** Open /events streams now. */
unsigned kvt_dash_streams(kvt_dash *d);

/** Ends every stream (each within its next wake-up, at once when waiting)
 * and refuses new ones; for a graceful stop before the daemon is stopped. */
void kvt_dash_stop(kvt_dash *d);

/** Frees the dashboard; call after the HTTP daemon is stopped (no stream
 * may still run). NULL is a no-op. */
void kvt_dash_destroy(kvt_dash *d);

#ifdef __cplusplus
}
#endif
#endif /* KVT_SERVER_DASHBOARD_H */
