//! TEMPORARY stub until the shutdown module lands.
use tokio::sync::watch;
#[derive(Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}
pub struct ShutdownTrigger {
    tx: watch::Sender<bool>,
}
impl ShutdownTrigger {
    pub fn new() -> (ShutdownTrigger, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (ShutdownTrigger { tx }, Shutdown { rx })
    }
    pub fn trigger(&self) {
        let _ = self.tx.send(true);
    }
}
impl Shutdown {
    pub fn is_shutdown(&self) -> bool {
        *self.rx.borrow()
    }
    pub async fn recv(&mut self) {
        let _ = self.rx.wait_for(|v| *v).await;
    }
}
