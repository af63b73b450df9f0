//! Writes 4 KiB at offset 0 through the vhost-user socket `socket`, waits up to an hour for
//! it, and prints how long it took to complete or fail: `cargo run --release -p mqblk-client --example timed_write
//! -- SOCKET`. `scripts/crafted-refcount-walk.sh` uses it to time a backend's first
//! allocation in a crafted image.
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket] = args.as_slice() else {
        anyhow::bail!("usage: timed_write SOCKET");
    };
    let mut c = mqblk_client::Client::connect(socket, 1)?;
    c.set_timeout(std::time::Duration::from_secs(3600));
    let began = std::time::Instant::now();
    let written = c.write(0, 0, &[0x5a; 4096]);
    let took = began.elapsed().as_secs_f64();
    match written {
        Ok(_) => println!("a 4 KiB write at offset 0 took {took:.3} s"),
        Err(e) => println!("a 4 KiB write at offset 0 failed after {took:.3} s: {e}"),
    }
    Ok(())
}
