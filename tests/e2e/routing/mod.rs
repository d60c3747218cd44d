//! Routing and translation on the node: outbound NAT, Services through kube-proxy, and routes from Node objects.

mod nat;
mod node_routes;
mod services;
