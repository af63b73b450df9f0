# Sourced by the scripts that serve a crafted image with a given mqblk binary
# (crafted-chain-memory.sh, crafted-refcount-walk.sh).

# crafted_setup EXAMPLE DIR: from the repository's root, builds mqblk-client's EXAMPLE (release;
# its path in $client), then makes DIR and enters it.
crafted_setup() {
    cd "$(dirname "${BASH_SOURCE[1]}")/.."
    cargo build --release -q -p mqblk-client --example "$1"
    client=$PWD/target/release/examples/$1
    mkdir -p "$2"; cd "$2"
}

# crafted_serve BIN SOCKET KEYS: serves the export socket=SOCKET,KEYS with BIN in the background
# (its pid in $served, its log in serve.log) and waits up to 10 s for the socket.
crafted_serve() {
    rm -f "$2"
    "$1" serve --export "socket=$2,$3" > serve.log 2>&1 &
    served=$!
    for _ in $(seq 100); do [ -S "$2" ] && break; kill -0 $served 2>/dev/null || break; sleep 0.1; done
}
