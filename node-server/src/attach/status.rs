//! STATUS: whether the node can serve an ADD now.

use super::{blocking, Node};
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
impl Node {
    /// The daemon's readiness (`/readyz`): its state store answers. Pool
    /// room is STATUS's business, not readiness's: a full node must not
    /// hold up a rolling update of the daemon.
    pub async fn ready(&self) -> Result<()> {
        let store = self.store.clone();
        blocking(move || store.probe())
            .await
            .map_err(|e| Error::NotReady(format!("the state store does not answer: {e}")))
    }

    /// STATUS: ready for ADD when the store answers and every pool has room.
    pub async fn status(&self) -> Result<Vec<u8>> {
        self.ready().await?;
        let Some(shortage) = lock(&self.pools).shortage() else {
            return Ok(tether_cni::empty_result());
        };
        let (detail, family) = (shortage.detail, shortage.families[0]);
        match &self.cluster {
            // A full block is fine while a new one can be claimed.
            Some(c) => match c.probe().await {
                Ok(()) => Ok(tether_cni::empty_result()),
                Err(e) => Err(Error::NotReady(format!(
                    "{detail}, and no new {} block can be claimed: {e}",
                    family.name()
                ))),
            },
            None => Err(Error::NotReady(format!("pool exhausted: {detail}"))),
        }
    }
}
