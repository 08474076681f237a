/* Callgrind's client requests as plain C functions, for Python (ctypes) to call: Python cannot issue a
 * client request itself (it is a magic instruction sequence that only valgrind.h's macros write).
 * benchmarks/instructions.py compiles this file with gcc into a temporary folder and loads it; outside
 * valgrind every request does nothing. The headers come with Debian's valgrind package. */
#include <valgrind/callgrind.h>

/* Start instrumenting (run under --instr-atstart=no: the imports before it run uninstrumented, faster). */
void instrument(void) { CALLGRIND_START_INSTRUMENTATION; }

/* Switch event collection on or off (run under --collect-atstart=no: nothing counts until the first call). */
void toggle_collect(void) { CALLGRIND_TOGGLE_COLLECT; }

/* Reset the counters, so that the next dump holds only what ran after this call. */
void zero_stats(void) { CALLGRIND_ZERO_STATS; }

/* Write the counters to the next numbered profile file, its "desc: Trigger:" line naming `label`. */
void dump_stats(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }

/* Nonzero under valgrind. */
int on_valgrind(void) { return RUNNING_ON_VALGRIND; }
