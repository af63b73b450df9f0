//! Commands from the frontend session: starting and stopping queues, replacing a call eventfd,
//! swapping guest memory, the cache mode, the dirty log, shutdown; and from the daemon, the QoS
//! buckets. Stops and memory swaps wait until the requests they concern have completed, so that
//! no completion ever writes to memory the frontend has taken back (requests waiting for QoS
//! admission then start without waiting).

use std::sync::Arc;

use super::ring::{write_eventfd, Token};
use super::thread::IoThread;
use super::vq::Vq;
use virtio_queue::QueueT;

use super::Command;

impl IoThread {
    /// Handles every waiting command.
    pub(super) fn handle_commands(&mut self) {
        while let Ok(cmd) = self.commands.try_recv() {
            match cmd {
                Command::Start {
                    local,
                    index,
                    queue,
                    kick,
                    call,
                    inflight,
                    resubmit,
                } => {
                    if local >= self.queues.len() {
                        tracing::error!(local, "start for a queue this thread does not own");
                        continue;
                    }
                    self.generations[local] = self.generations[local].wrapping_add(1);
                    let generation = self.generations[local];
                    let tracked = inflight.is_some();
                    let vq = Vq::new(
                        index,
                        queue,
                        kick,
                        call,
                        generation,
                        inflight,
                        self.mem.as_deref(),
                    );
                    let kick_fd = vq.kick_fd();
                    self.queues[local] = Some(vq);
                    let token = Token::Kick {
                        local: local as u16,
                        generation,
                    };
                    self.ring.push_poll(kick_fd, token, &mut self.counters);
                    self.resubmit(local, &resubmit);
                    // With in-flight tracking this may be a restart after a crash: requests the
                    // previous backend completed may never have been signalled (it died with the
                    // notification still queued), and the guest, waiting, will not kick. One
                    // spurious interrupt is harmless; a lost one hangs the guest.
                    if tracked {
                        if let Some(call) =
                            self.queues[local].as_ref().and_then(|q| q.call.as_ref())
                        {
                            write_eventfd(call);
                        }
                    }
                    tracing::debug!(queue = index, resubmitted = resubmit.len(), "queue started");
                }
                Command::Stop { local, reply } => match self.queues.get_mut(local) {
                    Some(Some(q)) => {
                        q.stop_reply = Some(reply);
                        self.admission_due = true;
                    }
                    _ => {
                        let _ = reply.send(0);
                    }
                },
                Command::SetCall { local, call } => {
                    // Queued notifications name the old descriptor: submit them first.
                    self.ring.submit(&mut self.counters);
                    if let Some(Some(q)) = self.queues.get_mut(local) {
                        q.call = call;
                    }
                }
                Command::SetMem { mem, reply } => {
                    // A private copy of the region table (the mappings themselves are shared):
                    // the reference counts this thread touches are then its own.
                    let private = mem.map(|m| Arc::new((*m).clone()));
                    self.pending_mem = Some((private, reply));
                    self.admission_due = true;
                }
                Command::SetWriteback(wb) => self.writeback = wb,
                Command::SetThrottle(throttle) => {
                    self.throttle = throttle;
                    self.admission_due = true;
                }
                Command::SetCapacity { sectors, reply } => {
                    self.limits.capacity_sectors = sectors;
                    self.capacity_barrier.push((self.slots.snapshot(), reply));
                }
                Command::SetDirtyLog { log, used, reply } => {
                    self.dirty.set(log, used);
                    let _ = reply.send(());
                }
                #[cfg(debug_assertions)]
                Command::InjectFault(fault) => fault.inflict(),
                Command::Shutdown => {
                    self.shutdown = true;
                    self.admission_due = true;
                    for q in self.queues.iter_mut().flatten() {
                        if q.stop_reply.is_none() {
                            let (tx, _rx) = std::sync::mpsc::sync_channel(1);
                            q.stop_reply = Some(tx);
                        }
                    }
                }
            }
        }
    }

    /// Completes the stops and the memory swap whose requests have drained.
    pub(super) fn finish_stops(&mut self) {
        for local in 0..self.queues.len() {
            let drained = matches!(&self.queues[local],
                Some(q) if q.stop_reply.is_some() && q.in_flight == 0);
            if !drained {
                continue;
            }
            let mut q = self.queues[local].take().expect("checked");
            // The used ring's last notification fields (written after its last used entry)
            // are marked too before the frontend hears that the ring stopped.
            if self.dirty.is_on() {
                self.dirty
                    .used_ring(local, q.queue.size(), &mut self.counters);
            }
            // Publish what completed before stopping.
            if let Some(mem) = self.mem.as_deref() {
                if let Some(used) = q.take_notification(mem) {
                    if let Some(call) = q.call.as_ref() {
                        self.counters.count_notification(used);
                        self.ring.push_notify(call, &mut self.counters);
                    }
                }
            }
            // Cancel the kick poll, and hand every queued entry to the kernel before the
            // queue's descriptors are closed: entries name descriptors by number, and a number
            // closed before submission could be reused by another thread.
            let token = Token::Kick {
                local: local as u16,
                generation: q.generation,
            };
            self.ring.push_poll_remove(token, &mut self.counters);
            self.ring.submit(&mut self.counters);
            let (index, next_avail, reply) = (q.index, q.queue.next_avail(), q.stop_reply.take());
            // The queue's eventfds close before the frontend hears that it stopped.
            drop(q);
            tracing::debug!(queue = index, next_avail, "queue stopped");
            if let Some(r) = reply {
                let _ = r.send(next_avail);
            }
        }
        let slots = &self.slots;
        self.capacity_barrier.retain(|(snapshot, reply)| {
            let done = slots.all_done(snapshot);
            if done {
                let _ = reply.send(());
            }
            !done
        });
        if self.pending_mem.is_some() && self.slots.in_use() == 0 {
            let (mem, reply) = self.pending_mem.take().expect("checked");
            self.mem = mem;
            if self.tuning.fixed_buffers && self.channel.file_fd().is_some() {
                self.ring.register_buffers(self.mem.as_deref());
            }
            let _ = reply.send(());
            for q in self.queues.iter_mut().flatten() {
                q.remap(self.mem.as_deref());
                q.pending = true;
            }
        }
    }
}
