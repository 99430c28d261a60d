//! The confirm class: confirm.select puts the channel in confirm mode (publishes are then
//! acknowledged with basic.ack, or basic.nack when a queue refused them).

use amq_protocol::protocol::{AMQPClass, confirm};

use super::{ChannelTable, not_from_client};
use crate::amqp::reply::AmqpError;
use crate::server::connection_context::ConnectionContext;

impl ChannelTable {
    /// Handles one method of the confirm class on channel `ch`.
    pub(super) fn confirm_method(
        &mut self,
        method: confirm::AMQPMethod,
        ch: u16,
        s: &ConnectionContext,
    ) -> Result<(), AmqpError> {
        match method {
            confirm::AMQPMethod::Select(sel) => {
                if let Some(local) = self.channels.get_mut(&ch) {
                    local.confirm = true;
                }
                if !sel.nowait {
                    Self::reply(
                        s,
                        ch,
                        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
                    );
                }
            }
            _ => return Err(not_from_client()),
        }
        Ok(())
    }
}
