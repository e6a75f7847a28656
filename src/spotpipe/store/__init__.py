"""The store clients behind one interface (torch's TCPStore, etcd), the mailbox, the boards,
heartbeats and abort watchers: what workers, shadows and agents share to talk through the
store. Everything that crosses it is a sealed `spotpipe.protocol` message."""
