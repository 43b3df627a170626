/*
 * kvtier/kvtier.h: the umbrella header: every stable kvtier module, and the
 * version of the headers.
 *
 *   #include <kvtier/kvtier.h>
 *
 * is the same as including each header below. The research API of
 * kvtier/experimental/ is included too when KVT_EXPERIMENTAL is defined
 * before this header (it may change in any release).
 *
 * The version is that of the headers the program was compiled with; it
 * changes with the library's (the shared library's soname is
 * libkvtier.so.KVT_VERSION_MAJOR).
 */
#ifndef KVTIER_KVTIER_H
#define KVTIER_KVTIER_H

/** Version of these headers: MAJOR.MINOR.PATCH. */
#define KVT_VERSION_MAJOR 0
#define KVT_VERSION_MINOR 1
#define KVT_VERSION_PATCH 0
/** The version as one number, MAJOR * 10000 + MINOR * 100 + PATCH, for
 * `#if KVT_VERSION >= 100` tests. */
#define KVT_VERSION (KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH)
/** The version as a string, "MAJOR.MINOR.PATCH". */
#define KVT_VERSION_STRING "0.1.0"

#include "kvtier/common.h"
#include "kvtier/buffer.h"
#include "kvtier/cache.h"
#include "kvtier/tier.h"
#include "kvtier/tier_chain.h"
#include "kvtier/retention.h"
#include "kvtier/prompt_cache.h"
#include "kvtier/store.h"
#include "kvtier/remote.h"
#include "kvtier/publish.h"
#include "kvtier/service.h"
#include "kvtier/pool.h"
#include "kvtier/io.h"
#include "kvtier/residency.h"

#ifdef KVT_EXPERIMENTAL
#include "kvtier/experimental/retention_block.h"
#endif

#endif /* KVTIER_KVTIER_H */
