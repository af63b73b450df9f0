//! The tasks a metadata worker runs at once: each job, and each group commit, is a future
//! (imago's calls are asynchronous), polled when what it waits for is done: its ring entry
//! ([`uring_io`](super::uring_io)) or an imago lock. A lock released by a task of another
//! worker wakes this worker through its wake eventfd, whose read is on the worker's ring.

use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::ThreadId;

/// A task's wake-up: a flag the worker checks, and the worker's eventfd when woken from
/// another thread (the worker may be waiting on its ring).
struct TaskWaker {
    woken: AtomicBool,
    wake: Arc<OwnedFd>,
    worker: ThreadId,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.woken.swap(true, Ordering::AcqRel) && std::thread::current().id() != self.worker {
            let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        }
    }
}

struct Task<T> {
    future: Pin<Box<dyn Future<Output = T>>>,
    waker: Arc<TaskWaker>,
}

/// A worker's tasks (it runs on the worker's thread only).
pub struct Executor<T> {
    tasks: Vec<Option<Task<T>>>,
    free: Vec<usize>,
    live: usize,
    wake: Arc<OwnedFd>,
    worker: ThreadId,
}

impl<T> Executor<T> {
    /// Tasks of the calling thread, woken from other threads through `wake`.
    pub fn new(wake: Arc<OwnedFd>) -> Self {
        Executor {
            tasks: Vec::new(),
            free: Vec::new(),
            live: 0,
            wake,
            worker: std::thread::current().id(),
        }
    }

    /// Tasks not finished yet.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Adds a task, to be polled at the next [`run`](Self::run).
    pub fn spawn(&mut self, future: impl Future<Output = T> + 'static) {
        let task = Task {
            future: Box::pin(future),
            waker: Arc::new(TaskWaker {
                woken: AtomicBool::new(true),
                wake: self.wake.clone(),
                worker: self.worker,
            }),
        };
        self.live += 1;
        match self.free.pop() {
            Some(i) => self.tasks[i] = Some(task),
            None => self.tasks.push(Some(task)),
        }
    }

    /// Polls woken tasks until none is woken; what finished tasks return goes to `done`.
    pub fn run(&mut self, done: &mut impl FnMut(T)) {
        loop {
            let mut polled = false;
            for i in 0..self.tasks.len() {
                let Some(task) = self.tasks[i].as_mut() else {
                    continue;
                };
                if !task.waker.woken.swap(false, Ordering::AcqRel) {
                    continue;
                }
                polled = true;
                let waker = Waker::from(task.waker.clone());
                if let Poll::Ready(out) =
                    task.future.as_mut().poll(&mut Context::from_waker(&waker))
                {
                    self.tasks[i] = None;
                    self.free.push(i);
                    self.live -= 1;
                    done(out);
                }
            }
            if !polled {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use rustix::event::{eventfd, EventfdFlags};

    use super::super::uring_io::Reactor;
    use super::*;

    #[test]
    fn a_task_woken_from_another_thread_runs_to_its_end() {
        let (done_tx, done_rx) = mpsc::channel();
        // The worker, on a thread of its own (a broken wake-up would leave it waiting).
        std::thread::spawn(move || {
            let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC).unwrap());
            let reactor = Reactor::new(io_uring::IoUring::new(8).unwrap(), wake.clone(), None);
            let mut tasks = Executor::new(wake);
            let (tx, rx) = futures::channel::oneshot::channel::<u32>();
            tasks.spawn(async move { rx.await.unwrap() + 1 });
            tasks.spawn(async { 100 });
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                tx.send(6).unwrap();
            });
            let mut out = Vec::new();
            loop {
                tasks.run(&mut |v| out.push(v));
                if tasks.live() == 0 {
                    break;
                }
                reactor.wait().unwrap();
            }
            done_tx.send(out).unwrap();
        });
        let out = done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the worker was never woken");
        assert_eq!(out, [100, 7]);
    }
}
