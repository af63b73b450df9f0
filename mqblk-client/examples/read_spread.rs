//! Reads 4 KiB at `count` offsets `step` bytes apart (from 0) through the vhost-user socket
//! `socket`, one request at a time: `cargo run --release -p mqblk-client --example read_spread
//! -- SOCKET COUNT STEP`. `scripts/crafted-chain-memory.sh` uses it to make a backend read
//! where a crafted chain's tables are.
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket, count, step] = args.as_slice() else {
        anyhow::bail!("usage: read_spread SOCKET COUNT STEP");
    };
    let (count, step): (u64, u64) = (count.parse()?, step.parse()?);
    let mut c = mqblk_client::Client::connect(socket, 1)?;
    c.set_timeout(std::time::Duration::from_secs(60));
    for i in 0..count {
        c.read_vec(0, i * step, 4096)?;
    }
    println!("read {count} blocks of 4 KiB, {step} bytes apart");
    Ok(())
}
