//! Real QEMU guests on tether's tap binding, live-migrated between tetherd nodes.

mod vm_connections;
mod vm_guest;
