// jaxring's own threads, for the waits that must not happen on XLA's.
//
// XLA:CPU runs the devices of one process on a few threads: each device's own thread, plus an
// intra-op pool as large as the machine has cores (2 here), onto which its thunk executor hands
// independent thunks. A collective call that sleeps on one of those threads until its peers
// arrive can wait forever: a peer's call, or the lax collective (itself blocking) that a sleeping
// device must reach before its peers can finish theirs, may sit queued behind it on the same
// few threads. So a CPU handler whose peers have not all arrived within
// Config::hand_off_after_seconds hands the rest of its call to one of these threads and returns a
// future to XLA (see cpu/handlers.cc); XLA's thread goes on with other work.
#pragma once

#include <cstdint>
#include <functional>

namespace jaxring {

// Runs `task` on a jaxring thread: an idle one, or a new one if none is idle, so a task never
// waits for another to finish. Threads idle for a while exit. Throws (std::system_error where no
// thread can be started), leaving `task` not run.
void HandOff(std::function<void()> task);

// How many tasks HandOff has been given since the library loaded (tests check that a
// configuration makes calls hand off).
int64_t HandOffCount();

}  // namespace jaxring
