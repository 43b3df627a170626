/*
 * kvtier/pool.h: process-wide limits shared by independently managed caches.
 *
 * One kvt_pool holds a finite limit on each of four independent axes (host
 * RAM bytes of prompt caches, KV bytes of admitted requests, disk bytes of
 * SSD roots, remote write bytes in flight). Every manager that spends one of
 * them (a cache service, an SSD root, a remote tier) joins the pool with a
 * named membership and charges its bytes through it, so two services or two
 * SSD roots of one process share one limit instead of each owning a budget.
 *
 * Admission is two-phase, so bytes are never uncounted and never counted
 * twice:
 *   kvt_pool_reserve   charges the bytes to the member as reserved; refused
 *                      (nothing charged) when they do not fit the axis
 *   kvt_pool_publish   the bytes now exist in the manager: they move from
 *                      reserved to the member's occupancy (still charged)
 *   kvt_pool_drop      the admission failed or was abandoned: uncharged
 *   kvt_pool_release   published bytes leave the manager (evicted, freed)
 * The axis total (reserved + published over all members) never passes the
 * limit at any moment; the report gives occupancy and high-water marks per
 * axis, per member and in total.
 *
 * Thread-safety: every call is thread-safe (one mutex per pool), except that
 * a reservation handle is used by one thread at a time and ends exactly once
 * (publish or drop), and kvt_pool_destroy runs alone.
 */
#ifndef KVTIER_POOL_H
#define KVTIER_POOL_H

#include "kvtier/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The independent axes of a pool (all in bytes). */
typedef enum kvt_pool_axis {
    KVT_POOL_RAM = 0,    /**< host RAM held by prompt caches (RAM tier) */
    KVT_POOL_KV = 1,     /**< KV cache bytes of admitted requests */
    KVT_POOL_DISK = 2,   /**< disk bytes of SSD roots */
    KVT_POOL_REMOTE = 3, /**< remote (Redis) write bytes in flight */
    KVT_POOL_AXES = 4    /**< number of axes, not an axis */
} kvt_pool_axis;

/** Limits of a pool: limit[axis] in bytes; 0 means the axis is not limited
 * (it is still counted and reported). */
typedef struct kvt_pool_limits {
    uint64_t limit[KVT_POOL_AXES];
} kvt_pool_limits;

/** The fields of one axis's occupancy, one list: X(name, kind, help), all
 * uint64 bytes except refusals (a count); kind "gauge" or "counter" (for
 * Prometheus). The struct, the JSON report and /metrics come from it. */
#define KVT_POOL_USAGE_FIELDS(X)                                                              \
    X(limit, gauge, "the axis limit in bytes (0: not limited); the same in member rows")     \
    X(reserved, gauge, "bytes charged by reservations not yet published or dropped")          \
    X(published, gauge, "bytes published and not yet released")                              \
    X(used, gauge, "reserved + published bytes")                                             \
    X(high_water, gauge, "the largest used ever seen, bytes")                                \
    X(refusals, counter, "reservations refused on this axis (limit reached)")

/** Occupancy of one axis, for one member or for the whole pool (see
 * KVT_POOL_USAGE_FIELDS). */
typedef struct kvt_pool_usage {
#define KVT__POOL_USAGE_FIELD(name, kind, help) uint64_t name;
    KVT_POOL_USAGE_FIELDS(KVT__POOL_USAGE_FIELD)
#undef KVT__POOL_USAGE_FIELD
} kvt_pool_usage;

/** Whole-pool report: per-axis totals over every member. */
typedef struct kvt_pool_report {
    kvt_pool_usage axis[KVT_POOL_AXES];
    uint64_t members; /**< memberships currently joined */
} kvt_pool_report;

typedef struct kvt_pool kvt_pool;
typedef struct kvt_pool_member kvt_pool_member;
typedef struct kvt_pool_reservation kvt_pool_reservation;

/** The axis name used in messages and JSON: "ram", "kv", "disk", "remote"
 * ("unknown" for anything else). Static string. Thread-safe. */
KVT_API const char *kvt_pool_axis_name(kvt_pool_axis axis);

/** Creates a pool with the given limits (copied).
 *
 * @param limits the limits; NULL means no axis is limited.
 * @param out receives the pool; caller ends it with kvt_pool_destroy.
 * @return 0; KVT_EINVAL when out is NULL; KVT_ENOMEM. On error *out is NULL.
 * Thread-safe.
 */
KVT_API int kvt_pool_create(const kvt_pool_limits *limits, kvt_pool **out);

/** Ends a pool. Every membership still joined is left first (its
 * reservations dropped, its bytes released) and its handle freed, so no
 * membership or reservation handle may be used afterwards. NULL is a no-op.
 * Not thread-safe: no other call on this pool may run or follow. */
KVT_API void kvt_pool_destroy(kvt_pool *pool);

/** Joins the pool as a named manager (e.g. "service:stories260K",
 * "ssd:/var/cache/kvtier").
 *
 * @param name non-empty UTF-8, at most 255 bytes, unique among the joined
 *   members (copied).
 * @param out receives the membership; ended by kvt_pool_leave.
 * @return 0; KVT_EINVAL (NULL argument, empty, too long or non-UTF-8 name);
 *   KVT_EBUSY when a joined member already has the name; KVT_ENOMEM. On
 *   error *out is NULL and nothing joined. Thread-safe.
 */
KVT_API int kvt_pool_join(kvt_pool *pool, const char *name, kvt_pool_member **out);

/** Leaves the pool: drops the member's open reservations (their handles are
 * freed and must not be used again), releases its published bytes and frees
 * the membership. NULL is a no-op. Thread-safe against calls of other
 * members; no call on this member may run concurrently or follow. */
KVT_API void kvt_pool_leave(kvt_pool_member *member);

/** Reserves bytes on one axis for this member.
 *
 * The bytes are charged at once (they count toward the axis limit) and stay
 * charged until kvt_pool_publish or kvt_pool_drop ends the reservation.
 * Reserving 0 bytes succeeds and charges nothing.
 *
 * @param bytes bytes to charge.
 * @param out receives the reservation handle; ended exactly once by
 *   kvt_pool_publish or kvt_pool_drop (or by kvt_pool_leave).
 * @return 0;
 *   KVT_ELIMIT: bytes exceed the whole axis limit (will never fit);
 *   KVT_EAGAIN: does not fit beside what is charged now (retry after
 *     releases);
 *   both with a message naming the axis, the member, the bytes asked and the
 *   bytes free (kvt_last_error), and counted in the axis refusals;
 *   KVT_EINVAL: NULL argument or axis out of range; KVT_ENOMEM.
 *   On error *out is NULL and nothing is charged. Thread-safe.
 */
KVT_API int kvt_pool_reserve(kvt_pool_member *member, kvt_pool_axis axis, uint64_t bytes,
                             kvt_pool_reservation **out);

/** Whether a reservation of `bytes` on `axis` would be granted now (a
 * question: nothing is charged and no refusal is counted).
 * @return 1 fits now; 0 does not fit beside what is charged now;
 *   KVT_ELIMIT: bytes exceed the whole axis limit (with the refusal's
 *   message); KVT_EINVAL: NULL member or axis out of range. Thread-safe. */
KVT_API int kvt_pool_fits(kvt_pool_member *member, kvt_pool_axis axis, uint64_t bytes);

/** The bytes of `axis` free now: limit - reserved - published, or
 * UINT64_MAX when the axis is not limited (0 for a NULL pool or a bad axis).
 * Thread-safe. */
KVT_API uint64_t kvt_pool_free(kvt_pool *pool, kvt_pool_axis axis);

/** The pool a membership belongs to (NULL for NULL). Thread-safe. */
KVT_API kvt_pool *kvt_pool_of(const kvt_pool_member *member);

/** The member's name as given to kvt_pool_join (borrowed, valid until the
 * member leaves; "" for NULL). Thread-safe. */
KVT_API const char *kvt_pool_member_name(const kvt_pool_member *member);

/** Publishes a reservation: its bytes now exist in the manager and move from
 * the member's reserved bytes to its published bytes (the axis total does not
 * change, so publishing never fails for lack of room). Frees the handle.
 * NULL is a no-op. Thread-safe. */
KVT_API void kvt_pool_publish(kvt_pool_reservation *res);

/** Drops a reservation: its bytes are uncharged (the admission failed or was
 * abandoned). Frees the handle. NULL is a no-op. Thread-safe. */
KVT_API void kvt_pool_drop(kvt_pool_reservation *res);

/** The bytes a reservation charges (0 for NULL). Thread-safe. */
KVT_API uint64_t kvt_pool_reservation_bytes(const kvt_pool_reservation *res);

/** Releases published bytes leaving the manager (evicted, freed).
 *
 * @return 0; KVT_EINVAL when member is NULL, the axis is out of range, or
 *   bytes exceed the member's published bytes on the axis (nothing is
 *   released then: the caller's accounting is wrong). Thread-safe.
 */
KVT_API int kvt_pool_release(kvt_pool_member *member, kvt_pool_axis axis, uint64_t bytes);

/** Whole-pool totals per axis (a snapshot under the pool's mutex).
 * @return 0; KVT_EINVAL when an argument is NULL. Thread-safe. */
KVT_API int kvt_pool_report_get(kvt_pool *pool, kvt_pool_report *out);

/** One member's usage per axis: out[axis] for each of the KVT_POOL_AXES axes
 * (high_water and refusals are the member's own).
 * @return 0; KVT_EINVAL when an argument is NULL. Thread-safe. */
KVT_API int kvt_pool_member_usage(kvt_pool_member *member, kvt_pool_usage out[KVT_POOL_AXES]);

/** The pool report as JSON:
 *   {"members":N,
 *    "axes":{"ram":{"limit":..,"reserved":..,"published":..,"used":..,
 *                   "high_water":..,"refusals":..},"kv":{..},..},
 *    "member_list":[{"name":"..","axes":{"ram":{..},..}},..]}
 * (members in join order; every number in bytes except counts).
 * @param out receives the string; caller frees with kvt_string_free.
 * @return 0; KVT_EINVAL; KVT_ENOMEM (then *out is NULL). Thread-safe. */
KVT_API int kvt_pool_report_json(kvt_pool *pool, char **out);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_POOL_H */
