// jaxring's own threads, for the waits that must not happen on XLA's.
//
// XLA:CPU runs the devices of one process on a few threads: each device's own thread, plus an
// intra-op pool as large as the machine has cores (2 here), onto which its thunk executor hands
// independent thunks. A collective call that sleeps on one of those threads until its peers
// arrive can wait forever: a peer's call, or the lax collective (itself blocking) that a sleeping
// device must reach before its peers can finish theirs, may sit queued behind it on the same
// few threads. So a CPU handler whose peers have not all arrived within kHandOffAfterSeconds hands
// the rest of its call to one of these threads and returns a future to XLA (see
// cpu/handlers.cc); XLA's thread goes on with other work.
#pragma once

#include <functional>

namespace jaxring {

// How long a CPU handler waits for its peers on XLA's thread (spinning, yielding, then asleep, as
// every wait does) before it hands the wait off. Peers that run are there well within it (a ring
// pass hop takes 5 us on 2 devices here and 10-15 us on 8), so calls in step never hand off; a
// hand-off costs a thread wake-up or two, and the device's program then goes on on the jaxring
// thread. A call whose peer is queued behind it loses this much once.
constexpr double kHandOffAfterSeconds = 1e-3;

// Runs `task` on a jaxring thread: an idle one, or a new one if none is idle, so a task never
// waits for another to finish. Threads idle for a while exit.
void HandOff(std::function<void()> task);

}  // namespace jaxring
